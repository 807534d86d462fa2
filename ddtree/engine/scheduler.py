"""Who runs: the waiting queue, the running rows, admission, abort and release. No tensors.

Running requests occupy target cache rows ``0 .. len(running) - 1`` in order, and drafting ones drafter
cache rows ``0 .. len(drafting) - 1``: every forward reads a leading slice of the caches. Releasing a row
moves the last row into the gap; the scheduler says which rows moved (``RowMove``) and the model runner
copies their keys and values.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from ddtree.engine.request import Request
from ddtree.errors import DDTreeError


@dataclass(frozen=True)
class RowMove:
    """Copy ``length`` leading cache columns of row ``src`` to row ``dst`` (``drafter``: of its cache)."""

    src: int
    dst: int
    length: int
    drafter: bool


class Scheduler:
    """FIFO admission into at most ``max_batch_size`` rows; each step admits (prefill) or runs a round."""

    def __init__(self, max_batch_size: int, max_prefill_tokens: int) -> None:
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # index = target cache row
        self.drafting: list[Request] = []  # index = drafter cache row
        self.auto_skip = 0  # rounds left in which "auto" rows run plain (set by the auto budget policy)
        self._ids = itertools.count()

    def new_id(self, request_id: str | None) -> str:
        """``request_id``, or a fresh one; refused when a live request already has it."""
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if self.find(request_id) is not None:
            raise DDTreeError(f"request_id {request_id!r} is already in use")
        return request_id

    def find(self, request_id: str) -> Request | None:
        return next(
            (r for r in itertools.chain(self.waiting, self.running) if r.request_id == request_id), None
        )

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def admits(self) -> bool:
        """The next step prefills (vLLM's default: a new request waits for at most the current step and its
        own prefill, running ones for at most one prefill between two rounds)."""
        return bool(self.waiting) and len(self.running) < self.max_batch_size

    def admit(self) -> list[Request]:
        """Waiting requests (FIFO) for free rows, as many as one padded prefill of at most
        ``max(max_prefill_tokens, the first prompt)`` tokens holds; they take the next rows, in order."""
        batch: list[Request] = []
        while self.waiting and len(self.running) + len(batch) < self.max_batch_size:
            longest = max([len(r.prompt_ids) for r in batch] + [len(self.waiting[0].prompt_ids)])
            if batch and longest * (len(batch) + 1) > self.max_prefill_tokens:
                break
            batch.append(self.waiting.popleft())
        for r in batch:
            r.row = len(self.running)
            self.running.append(r)
            if r.drafts:
                r.draft_row, r.draft_len = len(self.drafting), 0
                self.drafting.append(r)
        return batch

    def drafting_this_round(self) -> list[Request]:
        """The rows whose drafter runs this round: "auto" rows skip it during a stretch of plain rounds."""
        rows = [r for r in self.drafting if not (r.auto and self.auto_skip)]
        self.auto_skip = max(self.auto_skip - 1, 0)
        return rows

    def remove_waiting(self, request_id: str) -> Request | None:
        r = next((r for r in self.waiting if r.request_id == request_id), None)
        if r is not None:
            self.waiting.remove(r)
        return r

    def release(self, r: Request) -> list[RowMove]:
        """Free a running request's rows, keeping the running rows contiguous: the last row moves into the
        gap. Returns the cache rows to copy."""
        moves = []
        last = self.running.pop()
        if last is not r:
            moves.append(RowMove(last.row, r.row, last.start, drafter=False))
            last.row = r.row
            self.running[r.row] = last
        if r.drafts:
            last = self.drafting.pop()
            if last is not r:
                moves.append(RowMove(last.draft_row, r.draft_row, last.draft_len, drafter=True))
                last.draft_row = r.draft_row
                self.drafting[r.draft_row] = last
        r.row = r.draft_row = -1
        r.features = []
        return moves
