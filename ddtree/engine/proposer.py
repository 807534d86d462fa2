"""What each row proposes this round: one drafter pass over every drafting row, then each row's tree.

``ddtree`` rows get the best-first tree of their ``budget`` most probable draft prefixes, ``dflash`` rows the
drafter's argmax chain, ``ar`` rows (and rows that skip the drafter this round) the root alone. The drafter
also consumes the target features each round committed, so its cache follows the target's.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ddtree.capture import pick, upload
from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.request import Request
from ddtree.sampling import SamplingTensors, filtered_probs
from ddtree.tree import TreeBatch, TreeSpec, build_tree_batch, draft_candidates


class Proposer:
    """Drafter passes and trees over the model runner's drafter and drafter cache."""

    def __init__(self, runner: ModelRunner, auto_max_budget: int, sampling_aware_trees: bool) -> None:
        self.runner = runner
        self.auto_max_budget = auto_max_budget
        # When on, sampled rows build their tree from the drafter's distribution under the request's own
        # sampling transform (verification is unchanged). Off by default: measured, it did not pay.
        self.sampling_aware_trees = sampling_aware_trees

    def ingest(self, rows: list[Request]) -> None:
        """Give the drafter the prefilled chunks now, in the prefill's step (whose shapes vary anyway), so a
        round's drafter pass only ever sees what one round commits."""
        if rows:
            width = max(sum(x.shape[0] for x in r.features) for r in rows)
            self.draft_pass(rows, len(rows), width, self.runner.block_tables(rows), fixed=False)

    def draft(self, rows: list[Request]) -> torch.Tensor:
        """One drafter pass over these rows' [root, MASK x (block_size - 1)]; returns their draft logits
        [D, depth, V] (depth: as deep as the deepest row's tree can grow).

        A row's context may hold the features of several rounds (budget "auto" skips the drafter while
        drafting does not pay): the pass catches up on all of them, so the drafter's cache ends up exactly
        as if it had drafted every round. With fixed shapes the pass is padded to a batch bucket, with a
        context of one block: a longer backlog repeats the same pass, and the last one drafts.
        """
        if self.runner.fixed_shapes:
            b = pick(self.runner.batch_buckets, len(rows))
            slots = [*rows, *[None] * (b - len(rows))]
            tables = self.runner.block_tables(slots)
            hidden = self.draft_pass(slots, b, self.runner.drafter.block_size, tables, fixed=True)
            while any(r.features for r in rows):
                hidden = self.draft_pass(slots, b, self.runner.drafter.block_size, tables, fixed=True)
        else:
            width = max(sum(x.shape[0] for x in r.features) for r in rows)
            hidden = self.draft_pass(rows, len(rows), width, self.runner.block_tables(rows), fixed=False)
        depth = max(self.depth(r) for r in rows)
        hidden = hidden[: len(rows), 1 : 1 + depth].to(self.runner.draft_head.dtype)  # [D, depth, H]
        return F.linear(hidden, self.runner.draft_head, self.runner.draft_head_bias).float()  # [D, depth, V]

    def draft_pass(
        self,
        slots: list[Request | None],
        b: int,
        c: int,
        tables: np.ndarray,
        fixed: bool,
        span: int | None = None,
    ) -> torch.Tensor:
        """One drafter forward over ``b`` rows with block tables ``tables`` [b, width + 1] (``fixed``: a
        captured shape and span bucket).

        Slot i (its request, or None to idle) consumes up to ``c`` of its pending context features and
        places its block right after them. Returns the blocks' hidden states [b, S, H]; a row's drafts are
        valid once its whole context is consumed.

        Idle and padding rows write only the scratch column and see column 0, so they stay finite and
        change nothing.
        """
        bs, device = self.runner.drafter.block_size, self.runner.device
        scratch = self.runner.draft_cache.scratch
        width = len(self.runner.drafter.target_layer_ids) * self.runner.embed.embedding_dim
        features = torch.zeros(b, c, width, dtype=self.runner.dtype, device=device)  # [b, C, F * H]
        block = np.full((b, bs), self.runner.drafter.mask_token_id, dtype=np.int64)  # [b, S]
        ctx_positions = np.zeros((b, c), dtype=np.int64)
        ctx_cols = np.full((b, c), scratch, dtype=np.int64)
        block_cols = np.full((b, bs), scratch, dtype=np.int64)
        block_positions = np.broadcast_to(np.arange(bs), (b, bs))
        ends = np.ones(b, dtype=np.int64)
        for i, r in enumerate(slots):
            if r is None:
                continue
            pending = torch.cat(r.features) if len(r.features) > 1 else r.features[0] if r.features else None
            k = 0 if pending is None else min(c, pending.shape[0])
            if k:
                features[i, :k] = pending[:k]
                ctx_cols[i, :k] = ctx_positions[i, :k] = r.draft_len + np.arange(k)
                r.draft_len += k
                r.features = [pending[k:]] if pending.shape[0] > k else []
            if r.root >= 0:  # while prefilling there is no root yet (and the block is not read)
                block[i, 0] = r.root
            block_cols[i] = r.draft_len + np.arange(bs)  # after the consumed context
            ends[i] = r.draft_len + bs
        inputs = self.runner.inputs.load(
            fixed,
            block=block,
            features=features,
            ctx_positions=ctx_positions,
            ctx_cols=ctx_cols,
            block_positions=np.where(block_cols == scratch, block_positions, block_cols),
            block_cols=block_cols,
            ends=ends,
            tables=tables,
        )
        span = span or self.runner.span(int(ends.max()))
        # flex (compiled passes only: uncompiled, FlexAttention is a dense fallback over the whole pool)
        mask = (
            self.runner.block_mask(self.runner.draft_cache, inputs[-1], inputs[-2], None, bs)
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
        return min(self.room(r) - 1, self.runner.max_drafted)

    def budget(self, r: Request) -> int:
        """Nodes of the tree built this round; for "auto", candidates: a few more than chosen last time
        (building candidates costs host time whether or not they are verified)."""
        return min(self.auto_max_budget, r.auto_width + 4) if r.auto else r.budget

    def depth(self, r: Request) -> int:
        # A tree of `budget` nodes is at most `budget` deep: deeper rows would never be read.
        block = self.runner.drafter.block_size - 1
        depth = block if r.method == "dflash" else min(self.budget(r), block)
        return max(1, min(depth, self.room(r) - 1))

    def trees(self, rows: list[Request], drafting: list[Request], logits: torch.Tensor | None) -> TreeBatch:
        """Every row's tree, built on the device in one batch: the root alone (``ar``, or no draft this
        round), the argmax chain (``dflash``: branching 1) or the best-first tree (``ddtree``; with budget
        "auto", of up to ``auto_max_budget`` candidates). ``logits`` [D, depth, V] are the ``drafting``
        rows' draft logits."""
        b = len(rows)
        spec = TreeSpec(*(np.zeros(b, dtype=np.int64) for _ in range(3)))
        drafted = {id(r): i for i, r in enumerate(drafting)}
        vocab = logits.shape[-1] if logits is not None else 1
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
        roots = self.runner.inputs.upload(np.array([r.root for r in rows], dtype=np.int64))  # [B]
        if logits is None or not spec.budgets.any():
            return TreeBatch.root_only(roots)
        if self.sampling_aware_trees:
            logits = self.sampling_aware(drafting, logits)
        logits = grammar_first_level(drafting, logits)
        k = int(spec.topks.max())
        vals, ids = draft_candidates(logits, k)  # [D, depth, K] each
        if len(drafting) < b:  # rows that do not draft this round get candidates they never read
            at = self.runner.inputs.upload(np.array([drafted.get(id(r), 0) for r in rows]))
            vals, ids = vals[at], ids[at]
        return build_tree_batch(vals, ids, roots, spec)

    def sampling_aware(self, drafting: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """Sampled rows draft from the drafter's distribution under their own sampling transform (-inf =
        filtered out); verification is unchanged."""
        sampled = [i for i, r in enumerate(drafting) if not r.params.greedy]
        if not sampled:
            return logits
        sampling = SamplingTensors.from_params([drafting[i].params for i in sampled], logits.device)
        logits = logits.clone()
        logits[sampled] = filtered_probs(logits[sampled], sampling).log()  # [S, depth, V]
        return logits


def grammar_first_level(drafting: list[Request], logits: torch.Tensor) -> torch.Tensor:
    """Structured-output rows draft their first level from the tokens their grammar allows next (known
    before the tree: what follows the root), so no depth-1 node is one the grammar forbids. Deeper levels
    depend on the path and stay as drafted; verification masks every node either way."""
    constrained = [i for i, r in enumerate(drafting) if r.grammar is not None]
    if not constrained:
        return logits
    from ddtree.grammar import apply_masks, next_masks  # xgrammar: only for engines that serve them

    at = upload(np.asarray(constrained, dtype=np.int64), logits.device)
    masks = upload(next_masks([drafting[i].grammar for i in constrained]), logits.device)  # [C, W]
    logits = logits.clone()
    logits[at, 0] = apply_masks(logits[at, 0], masks)  # [C, V]
    return logits
