"""A signal at any moment of ``ddtree serve``'s start-up ends it cleanly (issue 45, item 5).

SIGTERM during the model load used to abort the process (SIGABRT, exit -6: "terminate called without an
active exception") in 3 of 10 launches: the interpreter's exit tore down torch under the loading thread.
Each launch here is a real ``ddtree serve`` (the built-in pair) signalled at a seeded random moment after
it started listening: while the test hook delays the load, while the weights load, while it warms up, or
once it is ready. (The drain after a signal, with requests in flight, is ``test_server_process``'s.)
"""

from __future__ import annotations

import random
import signal
import time

import pytest

from tests.server_helpers import ServerProcess, server_env

LOAD_DELAY = 0.5  # seconds the test hook sleeps before the load; the load itself takes about as long
MOMENTS = [round(random.Random(45).uniform(0, LOAD_DELAY + 1.0), 2) for _ in range(7)]
LAUNCHES = [(signal.SIGTERM if i % 2 == 0 else signal.SIGINT, moment) for i, moment in enumerate(MOMENTS)]


@pytest.mark.parametrize(("sig", "moment"), LAUNCHES, ids=[f"{s.name}-{m}s" for s, m in LAUNCHES])
def test_a_signal_at_any_moment_of_start_up_exits_0(tmp_path, sig, moment):
    env = server_env(DDTREE_TEST_LOAD_DELAY=str(LOAD_DELAY))
    proc = ServerProcess(["--threads", "1"], tmp_path / "server.log", env=env)
    try:
        time.sleep(moment)
        proc.proc.send_signal(sig)
        code = proc.wait(60)
    finally:
        proc.close()
    log = proc.log()
    assert code == 0, log
    assert "Traceback" not in log and "terminate called" not in log, log
