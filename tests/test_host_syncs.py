"""A round talks to the host at most twice: everything from the draft to the verdicts stays on the device.

On an accelerator every device->host read is a sync that idles the device; on the CPU the same calls are
what would sync. They are counted with a ``TorchFunctionMode`` over the calls that read a tensor on the
host (``tolist``, ``item``, ``cpu``, ``numpy`` and Python's ``bool`` / ``int`` / ``float`` / ``index`` of a
tensor) during one round of 16 rows. ``DDTREE_TEST_DEVICE=cuda`` runs the engine on CUDA
(``scripts/accelerator_check.sh`` also counts the syncs CUDA itself reports, with
``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ddtree import Engine, SamplingParams
from tests.conftest import tiny_drafter, tiny_target

READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


class HostReads(TorchFunctionMode):
    """Counts the host reads of tensors made under it, by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


SAMPLED = [
    SamplingParams(temperature=0.8, max_new_tokens=64, seed=1),
    SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=64, seed=2),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.95, max_new_tokens=64, seed=3),
    SamplingParams(temperature=1.0, min_p=0.05, max_new_tokens=64, seed=4),
]


DEVICE = os.environ.get("DDTREE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def engine() -> Engine:
    target = tiny_target()
    drafter = tiny_drafter(target)
    return Engine(target.to(DEVICE), drafter.to(DEVICE), max_num_seqs=16, budget=16)


def reads_in_one_round(engine: Engine, params: list[SamplingParams], methods: list[str]) -> list[str]:
    ids = [
        engine.add_request([5 + i, 9, 3 + i % 4], p, method=m)
        for i, (p, m) in enumerate(zip(params, methods, strict=True))
    ]
    while engine.scheduler.waiting or any(r.prefilling for r in engine.running):
        engine.step()  # prefill (its own step; the first token is read there)
    engine.step()  # one warm round: lazy initialisation is not the round's cost
    assert engine.num_running == 16 and not engine.scheduler.waiting
    with HostReads() as reads:
        engine.step()
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    return reads.calls


@pytest.mark.parametrize("kind", ["greedy", "sampled", "mixed"])
def test_one_round_of_sixteen_rows_reads_the_host_at_most_twice(engine, kind):
    greedy = SamplingParams(max_new_tokens=64)
    params = {
        "greedy": [greedy] * 16,
        "sampled": [SAMPLED[i % 4] for i in range(16)],
        "mixed": [greedy if i % 2 else SAMPLED[i % 4] for i in range(16)],
    }[kind]
    methods = ["ddtree"] * 12 + ["dflash", "dflash", "ar", "ar"]  # every tree shape in one batch
    calls = reads_in_one_round(engine, params, methods)
    assert 1 <= len(calls) <= 2, calls  # at least the verdicts: the counter sees reads
