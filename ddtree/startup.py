"""Where a loading engine is: the phase of start-up it runs (weights, profile, compile, warm-up), reported to
whoever listens on the loading thread (the server's ``/ready`` body), so a user waiting for readiness sees
progress rather than a bare 503, and logged with its duration."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

log = logging.getLogger(__name__)

Phase = Literal["weights", "profile", "compile", "warm-up"]
_local = threading.local()  # the listener of the thread that loads


@contextmanager
def listening(listener: Callable[[Phase], None]) -> Iterator[None]:
    """Call ``listener(phase)`` as each phase starts on this thread, for the block's duration."""
    _local.listener = listener
    try:
        yield
    finally:
        _local.listener = None


@contextmanager
def phase(name: Phase) -> Iterator[None]:
    """Start-up phase ``name`` runs on this thread for the block's duration."""
    listener = getattr(_local, "listener", None)
    if listener is not None:
        listener(name)
    t0 = time.perf_counter()
    yield
    log.info("start-up: %s took %.1f s", name, time.perf_counter() - t0)
