"""Stage times of a round without making the host wait for the device.

On an accelerator each stage boundary records a CUDA event on the stream and the times are read after the
round's last sync (the verdicts' copy), when every event has passed: the stages are timed as the device
ran them, and the round keeps its single wait. On a CPU every op is synchronous, so the host clock is
the stage's time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ddtree.engine.request import STAGES


class StageClock:
    """Marks the stages of one round (``stage``); ``seconds`` after the round's sync."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.events = enabled and device.type == "cuda"
        self.enabled = enabled
        self.marks: list[tuple[str, object, object]] = []  # (stage, start, end) events or host times

    def _point(self) -> torch.cuda.Event | float:
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = self._point()
        yield
        self.marks.append((name, start, self._point()))

    def seconds(self) -> dict[str, float]:
        """Each stage's seconds (zeros when disabled), read after the round's sync: every mark before it
        has passed, and the stream has nothing left to run before the last one (``elapsed_time`` fails on
        an event the device has not reached)."""
        out = dict.fromkeys(STAGES, 0.0)
        if self.events and self.marks:  # the last mark was recorded after the sync: let the stream pass it
            self.marks[-1][2].synchronize()
        for name, start, end in self.marks:
            out[name] += start.elapsed_time(end) / 1e3 if self.events else end - start
        return out
