"""What each row proposes this round: one drafter pass over every drafting row, then each row's tree.

``ddtree`` rows get the best-first tree of their ``budget`` most probable draft prefixes, ``dflash`` rows the
drafter's argmax chain, ``ar`` rows (and rows that skip the drafter this round) the root alone. A DFlash2
drafter's prefixes are scored over its candidate lattice (each token's log-prob given the one before it),
and its chain follows the lattice's greedy edges. The drafter also consumes the target features each round
committed, so its cache follows the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.request import Request
from ddtree.model.capture import upload
from ddtree.model.precision import rows_linear
from ddtree.request.penalties import NodePenalties
from ddtree.speculative.dflash2 import DFlash2Drafter
from ddtree.speculative.tree import TreeBatch, TreeShape, TreeSpec, build_tree_batch, draft_candidates


@dataclass(frozen=True)
class DraftSlot:
    """One row of a drafter pass: the target features it consumes now [k, F * H] (None: none), the
    drafter-cache column they start at, the root its block starts with (-1 while prefilling), and the
    positions its cache skipped before that column (``Request.draft_skipped``)."""

    features: torch.Tensor | None
    start: int
    root: int
    skipped: int = 0


class Proposer:
    """Drafter passes and trees over the model runner's drafter and drafter cache."""

    def __init__(self, runner: ModelRunner, auto_max_budget: int) -> None:
        self.runner = runner
        self.shapes = runner.shapes
        self.auto_max_budget = auto_max_budget

    def ingest(self, rows: list[Request], features: list[torch.Tensor]) -> None:
        """Give the drafter the prefilled chunks' target features ([T_i, F * H] per row, all consumed) now,
        in the prefill's step (whose shapes vary anyway), so a round's drafter pass only ever sees what one
        round commits."""
        if rows:
            slots = [DraftSlot(f, r.draft_len, r.root) for r, f in zip(rows, features, strict=True)]
            width = max(f.shape[0] for f in features)
            self.draft_pass(slots, width, self.shapes.block_tables(rows), fixed=False)

    def draft(self, rows: list[Request]) -> tuple[torch.Tensor, list[int]]:
        """One drafter pass over these rows' [root, MASK x (block_size - 1)]; returns the hidden states of
        their drafted positions [D, block_size - 1, H] (``trees`` runs the draft head over as many as the
        trees can use) and the context features each row's drafter consumed (all it had pending: the
        scheduler drops them).

        A row's context may hold the features of several rounds (budget "auto" skips the drafter while
        drafting does not pay): the pass catches up on all of them, at most ``DRAFT_BACKLOG`` blocks (the
        scheduler drops older ones, ``Scheduler._trim_backlog``). With fixed shapes the pass is padded to a
        batch bucket, with a context of one block: a longer backlog repeats the same pass, and the last one
        drafts.
        """
        pending = [torch.cat(r.features) if r.features else None for r in rows]  # [T_i, F * H]
        totals = [0 if p is None else p.shape[0] for p in pending]
        if self.shapes.fixed:
            b = self.shapes.batch_bucket(len(rows))
            tables = self.shapes.block_tables([*rows, *[None] * (b - len(rows))])
            c, done = self.runner.drafter.block_size, [0] * len(rows)
            while True:
                slots = [
                    DraftSlot(None if p is None else p[d : d + c], r.draft_len + d, r.root, r.draft_skipped)
                    for r, p, d in zip(rows, pending, done, strict=True)
                ]
                hidden = self.draft_pass([*slots, *[None] * (b - len(rows))], c, tables, fixed=True)
                done = [min(t, d + c) for t, d in zip(totals, done, strict=True)]
                if done == totals:
                    break
        else:
            slots = [
                DraftSlot(p, r.draft_len, r.root, r.draft_skipped) for r, p in zip(rows, pending, strict=True)
            ]
            hidden = self.draft_pass(slots, max(totals), self.shapes.block_tables(rows), fixed=False)
        return hidden[: len(rows), 1:], totals  # [D, block_size - 1, H]

    def timed_pass(self, rows: int) -> float:
        """Seconds of a drafter pass over ``rows`` idle rows with a block of context each (they write only
        the scratch column): the auto budget's cost model is seeded with these, as with the target's."""
        bs, tables = self.runner.drafter.block_size, self.shapes.block_tables([], rows)
        t = self.runner.now()
        with torch.inference_mode():
            self.draft_pass([None] * rows, bs, tables, fixed=False)
        return self.runner.now() - t

    def draft_logits(self, hidden: torch.Tensor, depth: int) -> torch.Tensor:
        """The draft head over the first ``depth`` drafted positions of ``hidden`` [D, block_size - 1, H]:
        float32 logits [D, depth, V]. The head is the target's LM head (V x H a position), so positions no
        tree reaches are not scored: a budget-1 tree reads one."""
        h = hidden[:, :depth].to(self.runner.draft_head.dtype)  # [D, depth, H], strided
        return rows_linear(h, self.runner.draft_head, self.runner.draft_head_bias).float()

    def draft_pass(
        self,
        slots: list[DraftSlot | None],
        c: int,
        tables: np.ndarray,
        fixed: bool,
        span: int | None = None,
    ) -> torch.Tensor:
        """One drafter forward over ``len(slots)`` rows with block tables ``tables`` [b, width + 1]
        (``fixed``: a captured shape and span bucket), reading nothing of a request but its slot.

        Slot i (None to idle) writes its at most ``c`` context features at its ``start`` column and places
        its block right after them. Returns the blocks' hidden states [b, S, H]; a row's drafts are valid
        once its whole context is consumed.

        Idle and padding rows write only the scratch column and see column 0, so they stay finite and
        change nothing.
        """
        b, bs, device = len(slots), self.runner.drafter.block_size, self.runner.device
        scratch = self.runner.draft_cache.scratch
        width = len(self.runner.drafter.target_layer_ids) * self.runner.embed.embedding_dim
        features = torch.zeros(b, c, width, dtype=self.runner.dtype, device=device)  # [b, C, F * H]
        block = np.full((b, bs), self.runner.drafter.mask_token_id, dtype=np.int64)  # [b, S]
        ctx_positions = np.zeros((b, c), dtype=np.int64)
        ctx_cols = np.full((b, c), scratch, dtype=np.int64)
        block_cols = np.full((b, bs), scratch, dtype=np.int64)
        block_positions = np.tile(np.arange(bs), (b, 1))  # idle rows: 0.. (finite, never read)
        ends = np.ones(b, dtype=np.int64)
        for i, slot in enumerate(slots):
            if slot is None:
                continue
            k = 0 if slot.features is None else slot.features.shape[0]
            if k:
                features[i, :k] = slot.features
                ctx_cols[i, :k] = slot.start + np.arange(k)
                ctx_positions[i, :k] = ctx_cols[i, :k] + slot.skipped
            if slot.root >= 0:  # while prefilling there is no root yet (and the block is not read)
                block[i, 0] = slot.root
            block_cols[i] = slot.start + k + np.arange(bs)  # after the consumed context
            block_positions[i] = block_cols[i] + slot.skipped
            ends[i] = slot.start + k + bs
        inputs = self.shapes.inputs.load(
            fixed,
            block=block,
            features=features,
            ctx_positions=ctx_positions,
            ctx_cols=ctx_cols,
            block_positions=block_positions,
            block_cols=block_cols,
            ends=ends,
            tables=tables,
        )
        span = span or self.shapes.span(int(ends.max()))
        # flex (compiled passes only: uncompiled, FlexAttention is a dense fallback over the whole pool)
        mask = (
            self.shapes.block_mask(self.runner.draft_cache, inputs[-1], inputs[-2], None, bs)
            if fixed
            else None
        )
        return (self.runner.draft_forward if fixed else self.runner.draft_forward_eager)(*inputs, span, mask)

    def columns(self, r: Request) -> int:
        """The most cache columns row r writes this round: its tree's nodes, or the drafter's block after
        its context (the scheduler takes the blocks before the round)."""
        if not r.drafts:
            return r.start + 1
        drafted = min(self.depth(r) if r.method == "dflash" else self.budget(r), self.drafted_room(r))
        return r.start + max(1 + drafted, self.runner.draft_block)

    def room(self, r: Request) -> int:
        """Tree nodes row r can still hold: its cache columns from ``start`` to the capacity."""
        return self.runner.max_model_len - r.start

    def drafted_room(self, r: Request) -> int:
        """Drafted nodes that fit in the row and in the largest node bucket (a tree never changes the
        output)."""
        return min(self.room(r) - 1, self.shapes.max_drafted)

    def budget(self, r: Request) -> int:
        """Nodes of the tree built this round; for "auto", candidates: a few more than chosen last time
        (building candidates costs host time whether or not they are verified)."""
        return min(self.auto_max_budget, r.auto_width + 4) if r.auto else r.budget

    def depth(self, r: Request) -> int:
        # A tree of `budget` nodes is at most `budget` deep: deeper rows would never be read.
        block = self.runner.drafter.block_size - 1
        depth = block if r.method == "dflash" else min(self.budget(r), block)
        return max(1, min(depth, self.room(r) - 1))

    def trees(self, rows: list[Request], drafting: list[Request], hidden: torch.Tensor | None) -> TreeBatch:
        """Every row's tree, built on the device in one batch: the root alone (``ar``, or no draft this
        round), the argmax chain (``dflash``: branching 1) or the best-first tree (``ddtree``; with budget
        "auto", of up to ``auto_max_budget`` candidates). ``hidden`` [D, block_size - 1, H]: the
        ``drafting`` rows' drafted positions (``draft``), scored here as deep as the trees can grow (with
        fixed shapes, as deep as the node bucket's: one tree graph per bucket). A DFlash2 drafter's trees
        are built over its lattice (``RoundShapes.tree_graph``: the lattice builder's graph)."""
        b = len(rows)
        spec = TreeSpec(*(np.zeros(b, dtype=np.int64) for _ in range(3)))
        drafted = {id(r): i for i, r in enumerate(drafting)}
        vocab = 1 if hidden is None else self.runner.draft_head.shape[0]  # the draft head's rows
        for i, r in enumerate(rows):
            room = self.drafted_room(r)
            if id(r) not in drafted or room < 1:
                continue
            depth = self.depth(r)
            if r.method == "dflash":
                spec.budgets[i], spec.topks[i], spec.depths[i] = min(depth, room), 1, depth
            else:
                budget = min(self.budget(r), room)
                k = budget if r.topk is None else r.topk
                spec.budgets[i], spec.topks[i], spec.depths[i] = budget, min(k, budget, vocab), depth
        runner, shapes = self.runner, self.shapes
        plain = lambda: TreeBatch.root_only(shapes.inputs.upload(np.array([r.root for r in rows])))  # noqa: E731
        if hidden is None or not spec.budgets.any():
            return plain()
        lattice = isinstance(runner.drafter, DFlash2Drafter)
        k = runner.drafter.settings.top_k if lattice else int(spec.topks.max())
        shape, bp = None, b
        if shapes.fixed:  # one tree graph per bucket: a batch bucket of rows, a node bucket wide
            n = shapes.node_bucket(int(spec.sizes(int(spec.budgets.max()), k, lattice).max()))
            if n == 1:
                return plain()
            bp = shapes.batch_bucket(b)
            shape = TreeShape.bucket(n, runner.drafter.block_size - 1, vocab)
            if not lattice:  # the bucket's ranks; a lattice keeps its own K candidates
                k = shape.k
            spec = TreeSpec(*(np.pad(x, (0, bp - b)) for x in (spec.budgets, spec.topks, spec.depths)))
        depth = shape.depths if shape is not None else max(self.depth(r) for r in drafting)
        logits = penalised_drafts(drafting, self.draft_logits(hidden, depth))  # [D, depth, V]
        logits = grammar_first_level(drafting, logits)
        if lattice:  # ids [D, depth, K], vals: edge log-probs [D, depth, K, K]
            anchors = shapes.inputs.upload(np.array([r.root for r in drafting]))  # [D]
            sampled = [i for i, r in enumerate(drafting) if not r.params.greedy]  # edges over the vocabulary
            ids, vals = runner.drafter.lattice(hidden[:, :depth], logits, anchors, sampled or None)
        else:
            vals, ids = draft_candidates(logits, k)  # [D, depth, K] each
        if len(drafting) < bp:  # rows that do not draft this round get candidates they never read
            at = np.zeros(bp, dtype=np.int64)
            at[:b] = [drafted.get(id(r), 0) for r in rows]
            where = shapes.inputs.upload(at)
            vals, ids = vals[where], ids[where]
        roots = np.zeros(bp, dtype=np.int64)
        roots[:b] = [r.root for r in rows]
        roots_t = shapes.inputs.upload(roots)  # [Bp]
        if shape is None:
            return build_tree_batch(vals, ids, roots_t, spec)
        return build_tree_batch(vals, ids, roots_t, spec, shape, shapes.tree_graph, rows=b)


def penalised_drafts(drafting: list[Request], logits: torch.Tensor) -> torch.Tensor:
    """Rows with penalties draft from draft logits [D, depth, V] penalised as the first level's target
    logits will be (the output's counts, each position's depth for min_tokens; a deeper node's own path is
    not known before the tree and is left out), so the tree holds what verification will accept. Without
    it a repetitive draft is what penalties forbid: tau 1.65 where unpenalised rounds reach 10.85 on the
    built-in pair. Verification penalises every node exactly either way."""
    at = [i for i, r in enumerate(drafting) if r.penalties is not None]
    if not at:
        return logits
    penalties = NodePenalties([drafting[i] for i in at], None, logits.shape[-1], logits.device)
    index = upload(np.asarray(at, dtype=np.int64), logits.device)
    logits[index] = penalties.drafts(logits[index]).to(logits.dtype)  # [G, depth, V]
    return logits


def grammar_first_level(drafting: list[Request], logits: torch.Tensor) -> torch.Tensor:
    """Structured-output rows draft their first level from the tokens their grammar allows next (known
    before the tree: what follows the root), so no depth-1 node is one the grammar forbids. Deeper levels
    depend on the path and stay as drafted; verification masks every node either way."""
    if not any(r.grammar is not None for r in drafting):
        return logits
    from ddtree.request.grammar import mask_next  # xgrammar: only for engines that serve it

    logits[:, 0] = mask_next(logits[:, 0], [r.grammar for r in drafting])  # [D, V]; the round's own copy
    return logits
