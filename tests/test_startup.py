"""Start-up: ``/ready`` names the phase a loading server is in, and the CPU's reduced memory profile (one
layer of each kind, two rows scaled, an eighth and a quarter of the span extrapolated, with its margin) is
an upper bound of the full largest step's peak.

The peaks are resident-set measurements, each in a fresh process (an earlier step's freed heap would hide
a later step's growth), of the built-in pair at shapes where the prefill dominates, the round dominates,
and both matter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from fastapi.testclient import TestClient

from ddtree import startup
from ddtree.engine import Engine
from ddtree.server import ServerConfig, create_app

PROFILE = """
import json, sys, torch
torch.set_num_threads(1)
from ddtree.engine import Engine
from ddtree.engine.memory import StepModel, extrapolated_peak, profile_step
engine = Engine.from_pretrained(kv_cache_memory="32MiB", max_model_len=2048)
r = engine.runner
model = StepModel(r.forward, r.lm_head, r.dtype, r.device, r.drafter, r.block_size)
shape, reduced = json.loads(sys.argv[1])
print(extrapolated_peak(model, *shape)(shape[3]) if reduced else profile_step(model, *shape))
"""


def peak(shape: tuple[int, int, int, int], reduced: bool) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROFILE, json.dumps([shape, reduced])],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "shape",
    [
        (512, 1, 17, 129),  # the prefill's mask, activations and gathers dominate
        (64, 16, 65, 129),  # the round's 16 x 65 distributions dominate
        (256, 8, 129, 129),  # both
    ],
    ids=["prefill", "round", "both"],
)
def test_the_reduced_profile_is_an_upper_bound_of_the_full_largest_steps_peak(shape):
    """Tokens, rows, nodes, blocks of the largest step: the extrapolated reduced profile (budgeted, as the
    engine plans with it on a CPU) is at least the full step's measured peak."""
    full, reduced = peak(shape, False), peak(shape, True)
    assert reduced >= full, (reduced / 2**20, full / 2**20)


def test_ready_names_the_start_up_phase_while_the_model_loads():
    gates = {name: threading.Event() for name in ("weights", "profile")}

    def factory() -> Engine:
        for name, gate in gates.items():
            with startup.phase(name):
                gate.wait(30)
        return Engine.from_pretrained()

    client = TestClient(create_app(factory, ServerConfig(model_name="tiny")))
    client.__enter__()
    try:
        for name, gate in gates.items():
            deadline = time.monotonic() + 30
            while (body := client.get("/ready").json()).get("phase") != name:
                assert time.monotonic() < deadline, body
                time.sleep(0.01)
            assert body["error"]["code"] == "model_loading" and f"({name}, " in body["error"]["message"]
            assert client.get("/health").json()["phase"] == name
            gate.set()
        deadline = time.monotonic() + 60
        while (ready := client.get("/ready")).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert ready.json()["phase"] is None
    finally:
        for gate in gates.values():
            gate.set()
        client.__exit__(None, None, None)
