"""Who runs: the waiting queue, the running requests, their KV blocks, prefix-cache hits, chunked prefill,
preemption. No tensors.

A step is either a prefill step (chunks of waiting or half-prefilled prompts, at most
``max_num_batched_tokens`` padded tokens) or a round (every decoding request). With requests decoding, a
prefill step never follows a prefill step: a running stream waits at most one prefill between two of its
rounds, however long the prompt that arrives, and that prefill is cut to ``decode_chunk`` tokens (what the
engine measured a few rounds' time to prefill). Blocks are taken as requests grow: a chunk's before its
prefill, a round's (the committed tokens, the tree's nodes and the drafter's block) before the round.
When a running request cannot grow, the most recently admitted one is preempted (vLLM's recompute mode):
its blocks are freed and it goes back to the front of the queue, to be prefilled again from its prompt and
the tokens it already emitted. A request admitted takes its longest cached prefix of full blocks
(``BlockManager.cached_prefix``: the target's keys/values and, drafting, the drafter's context) and
prefills the rest; after each step the rows' newly final full blocks are indexed for later requests.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddtree.engine.block_manager import BlockManager
from ddtree.engine.request import Request, RequestStatus, StepOutput, StreamDelta
from ddtree.errors import DDTreeError

# Drafter blocks of target features a row may have pending; older ones are dropped (``_trim_backlog``)
DRAFT_BACKLOG = 2


@dataclass(frozen=True)
class Chunk:
    """``tokens`` more of request's ``prefill_ids`` go into the cache this step, after ``computed``."""

    request: Request
    tokens: int

    @property
    def last(self) -> bool:
        """This chunk ends the request's prefill."""
        return self.request.computed + self.tokens == len(self.request.prefill_ids)


class Scheduler:
    """FIFO admission of up to ``max_num_seqs`` running requests into a pool of KV blocks."""

    def __init__(
        self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, draft_block: int
    ) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_chunk: int | None = None  # a prefill step's tokens while requests decode (engine-set)
        self.draft_block = draft_block  # columns a drafter pass writes after the context (0: no drafter)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; a round's batch keeps it
        self.requests: dict[str, Request] = {}  # every live (waiting or running) request, by id
        # rounds left in which "auto" rows of a kind (``Request.auto_kind``) run plain (the auto policy sets)
        self.auto_skip: dict[str, int] = {}
        self.num_preemptions = 0
        self._prefilled_last = False
        self._ids = itertools.count()

    def new_id(self, request_id: str | None) -> str:
        """``request_id``, or a fresh one; refused when a live request already has it."""
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise DDTreeError(f"request_id {request_id!r} is already in use")
        return request_id

    def add(self, r: Request) -> None:
        """Queue a new request (its id from ``new_id``) behind the waiting ones."""
        if r.request_id in self.requests:
            raise DDTreeError(f"request_id {r.request_id!r} is already in use")
        r.status = RequestStatus.WAITING
        self.requests[r.request_id] = r
        self.waiting.append(r)

    def find(self, request_id: str) -> Request | None:
        """The live request with this id, or None."""
        return self.requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def decoding(self) -> list[Request]:
        """The running requests past their prefill: a round's rows, in order."""
        return [r for r in self.running if not r.prefilling]

    def _prefill_tokens(self, r: Request, end: int) -> int:
        """Columns request r needs with ``end`` prefill tokens cached (a drafter writes its block after)."""
        return end + (self.draft_block if r.drafts else 0)

    def schedule_prefill(self) -> list[Chunk]:
        """This step's prefill chunks, or none (the step is a round): the half-prefilled requests first,
        then waiting ones in FIFO order while rows, the token budget and free blocks allow.

        Rows are padded to the longest chunk: a chunk of a later row is cut to that length, the first
        row's to the token budget. Without requests decoding, a full pool preempts from the back until the
        oldest half-prefilled request can go on (it always fits: the pool holds one whole request)."""
        if self.decoding and self._prefilled_last:
            self._prefilled_last = False
            return []
        chunks = self._chunks()
        while not chunks and not self.decoding and any(r.prefilling for r in self.running[1:]):
            self.preempt(self.running[-1])
            chunks = self._chunks()
        self._prefilled_last = bool(chunks)
        return chunks

    def _chunks(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        longest = 0
        budget = self.max_num_batched_tokens
        decoding = bool(self.decoding)
        if decoding and self.decode_chunk is not None:
            budget = min(budget, self.decode_chunk)
        candidates = [r for r in self.running if r.prefilling]
        # The waiting requests past max_num_seqs cannot be admitted: no need to copy the whole queue.
        room = max(self.max_num_seqs - len(self.running), 0)
        for k, r in enumerate(itertools.chain(candidates, list(itertools.islice(self.waiting, room + 1)))):
            new = k >= len(candidates)
            if new and len(self.running) >= self.max_num_seqs:
                break
            if new:
                r.prefill_ids = r.prompt_ids + r.output.token_ids[:-1]  # a preempted one: its output too
                hit = self.blocks.cached_prefix(r, len(r.prefill_ids) - 1)  # the last token makes logits
                r.computed = len(hit) * self.blocks.block_size
            remaining = len(r.prefill_ids) - r.computed
            if not chunks:
                tokens = min(remaining, budget)
            elif (len(chunks) + 1) * max(longest, remaining) <= budget:
                tokens = remaining
            elif (len(chunks) + 1) * longest <= budget:
                tokens = min(remaining, longest)
            else:
                break
            need = self._prefill_tokens(r, r.computed + tokens)
            if new:
                reserve = self.blocks.watermark if decoding else 0
                if not self.blocks.admit(r, hit, need, reserve):
                    r.prefill_ids, r.computed = [], 0
                    break
                r.draft_len = r.computed if r.drafts else 0  # a hit holds the drafter's context too
                if r.status is RequestStatus.WAITING:  # its first admission
                    r.stats.cached_tokens = r.computed
                self.waiting.remove(r)
                self.running.append(r)
                r.status = RequestStatus.PREFILLING
            elif not self.blocks.grow(r, need):
                break
            chunks.append(Chunk(r, tokens))
            longest = max(longest, tokens)
        return chunks

    def schedule_round(self, columns: Callable[[Request], int]) -> list[Request]:
        """Blocks for every decoding request's round (``columns(r)``: the most it can write), preempting
        from the back of the running list when the pool is out. Returns the round's rows."""
        for r in self.decoding:
            if r not in self.running:  # preempted for an older request in this loop
                continue
            while not self.blocks.grow(r, columns(r)):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is r:
                    break
        return self.decoding

    def cache_blocks(self, rows: list[Request]) -> None:
        """After a step: index the rows' full blocks whose keys/values are now final for later requests
        (the target's below the committed tokens or the prefilled prompt; a drafting row's up to where its
        drafter has consumed the context as well, and past a gap in its drafter's cache the target's
        alone)."""
        for r in rows:
            final = r.computed if r.prefilling else r.start
            self.blocks.cache(r, min(final, r.draft_aligned) if r.drafts else final, r.drafts)
            if r.drafts and r.draft_gap >= 0:  # past its drafter's gap: the target's keys/values alone
                self.blocks.cache(r, final, False)

    def update_from_output(self, out: StepOutput) -> list[StreamDelta]:
        """Apply a step's results to its requests (chunks prefilled, the drafter's context consumed and
        grown, tokens committed with their logprobs, grammar and stats, the auto budget's decisions), index
        the rows' newly final blocks and release the finished rows. Returns a delta per row whose output
        grew (a prefill's first token, a round's tokens)."""
        deltas = []
        for i, r in enumerate(out.rows):
            try:
                delta = self._apply(out, i, r)
            except Exception as exc:  # this row's output (text, stop strings, grammar) failed: its own error
                deltas.append(self.fail(r, exc))
                continue
            if delta is not None:
                deltas.append(delta)
        if out.auto_skip is not None:
            self.auto_skip.update(out.auto_skip)
        self.cache_blocks([r for r in out.rows if r.error is None])
        for r in out.rows:
            if r.output.finish_reason is not None and r.error is None:
                self.release(r)
        return deltas

    def _apply(self, out: StepOutput, i: int, r: Request) -> StreamDelta | None:
        """Row i's part of ``out``; its delta when its output grew."""
        if out.consumed[i]:
            r.draft_len += out.consumed[i]
            r.features = []  # a pass consumes all a row has pending
        if out.features[i] is not None:
            r.features.append(out.features[i])
            self._trim_backlog(r)
        if i in out.auto_widths:
            r.auto_width = out.auto_widths[i]
        if i in out.auto_rests:
            r.auto_rest, r.auto_worth = out.auto_rests[i]
            r.auto_backoff = r.auto_rest
        if out.auto_status is not None and r.auto:
            r.stats.auto = out.auto_status
        if out.drafted_nodes is not None:
            r.stats.drafted_nodes.append(out.drafted_nodes[i])
        if out.prompt_logprobs is not None and out.prompt_logprobs[i] is not None:
            r.prompt_logprobs = (r.prompt_logprobs or []) + out.prompt_logprobs[i]
        if out.prefilled is not None:
            r.computed += out.prefilled[i]
            r.stats.prefill_seconds += out.seconds  # every chunk's step, not only the last one's
            if r.computed < len(r.prefill_ids):
                return None
            r.status = RequestStatus.RUNNING
            r.start = r.computed
            if not out.tokens[i]:  # resumed after a preemption: its output is already written
                r.root = r.output.token_ids[-1]
                return None
        tokens, before = out.tokens[i], len(r.output.token_ids)
        taken = r.output.write(tokens, out.logprobs[i])
        if r.grammar is not None:
            r.grammar.accept(r.output.token_ids[before:])
        if out.prefilled is None:
            r.start += len(tokens)
            r.stats.acceptance_lengths.append(len(tokens))
            r.stats.decode_tokens += taken
        r.root = tokens[-1]
        return delta_of(r, before)

    def fail(self, r: Request, exc: BaseException) -> StreamDelta:
        """A step failed for r alone (``Engine`` found it by running r's part of the step alone): r leaves
        with finish_reason "error" and the reason; its blocks go back, none of them indexed by this step."""
        self._finish(r)
        r.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        r.output.finish_reason = "error"
        return delta_of(r, len(r.output.token_ids))

    def record_round_time(self, rows: list[Request], stage_seconds: dict[str, float], seconds: float) -> None:
        """A round's wall time and its stages' (shared by its rows), once the round is over."""
        for r in rows:
            for name, value in stage_seconds.items():
                r.stats.stage_seconds[name] += value
            r.stats.decode_seconds += seconds

    def abort(self, request_id: str) -> Request | None:
        """Drop a waiting or running request (a running one's blocks go back to the pool); its output
        finishes with "abort". None if no live request has that id."""
        r = self.find(request_id)
        if r is None:
            return None
        self._finish(r)
        r.output.finish_reason = "abort"
        return r

    def preempt(self, r: Request) -> None:
        """Free r's blocks and queue it first: its next prefill recomputes its prompt and output."""
        self._leave(r)
        r.status = RequestStatus.PREEMPTED
        r.computed = r.start = r.draft_len = r.draft_skipped = 0
        r.draft_gap = -1
        r.prefill_ids = []
        r.stats.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(r)

    def _trim_backlog(self, r: Request) -> None:
        """Keep at most ``DRAFT_BACKLOG`` drafter blocks of r's pending target features, dropping the oldest.

        An auto row in a stretch of plain rounds queues a round's features each round; a probe's drafter
        pass used to consume them all, a pass over the whole stretch (at 16 rows and T = 1 the probes' 88 ms
        of matmuls beside the plain rounds' 278 ms). The drafter's next tokens depend mostly on the latest
        positions, so the probe gets those and the older ones stay out of its context for good: their
        columns are never written (the cache goes on from the gap, each column shifted by ``draft_skipped``
        positions). A drafting row commits at most a block a round and never reaches the bound."""
        excess = sum(f.shape[0] for f in r.features) - DRAFT_BACKLOG * self.draft_block
        if excess <= 0:
            return
        if r.draft_gap < 0:
            r.draft_gap = r.draft_len
        r.draft_skipped += excess
        r.features = [torch.cat(r.features)[excess:]]  # [backlog, F * H]

    def drafting_this_round(self, rows: list[Request]) -> list[Request]:
        """Of the round's rows, those whose drafter runs: "auto" rows skip it during their kind's stretch of
        plain rounds, and an auto row alone while it rests (``Request.auto_rest``)."""

        def skips(r: Request) -> bool:
            return self.auto_skip.get(r.auto_kind, 0) > 0 or r.auto_rest > 0

        drafting = [r for r in rows if r.drafts and not (r.auto and skips(r))]
        self.auto_skip = {kind: left - 1 for kind, left in self.auto_skip.items() if left > 1}
        for r in rows:
            r.auto_rest = max(r.auto_rest - 1, 0)
        return drafting

    def release(self, r: Request) -> None:
        """A running request finished: its blocks go back to the pool (no KV copies)."""
        self._finish(r)

    def _finish(self, r: Request) -> None:
        """r leaves for good, from the queue or a row (its blocks back to the pool)."""
        if r.status in (RequestStatus.PREFILLING, RequestStatus.RUNNING):
            self._leave(r)
        elif r.status is not RequestStatus.FINISHED:
            self.waiting.remove(r)
        self.requests.pop(r.request_id, None)
        r.status = RequestStatus.FINISHED

    def _leave(self, r: Request) -> None:
        self.running.remove(r)
        self.blocks.free(r)
        r.features = []


def delta_of(r: Request, before: int) -> StreamDelta:
    """What request r's output gained since it held ``before`` tokens (its newly stable text is handed out
    now)."""
    return StreamDelta(
        request_id=r.request_id,
        token_ids=r.output.token_ids[before:],
        text=r.output.new_text(),
        finish_reason=r.output.finish_reason,
        stats=r.stats,
        logprobs=r.output.logprobs[before:],
        error=r.error,
        prompt_logprobs=r.prompt_logprobs if before == 0 else None,
    )
