"""Checking the proposals: every row's tree as one verify batch, the target's LM heads over its hidden
states, acceptance (the greedy walk, or tree rejection sampling with SGLang's contract), and the one commit
path that turns a verdict into tokens, packed KV and drafter features.

A verdict is, per row, ``(accepted node indices with the root first, emitted tokens with the bonus last)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ddtree.capture import pick
from ddtree.commit import pack_accepted, token_logprobs
from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.request import Request, StreamDelta
from ddtree.sampling import SamplingTensors, filtered_probs, sample_rows, sample_trees
from ddtree.tree import DraftTree, compile_ddtree_retrieve
from ddtree.verify import first_child_chain, follow_verified_tree, tree_verify_inputs

Verdict = tuple[list[int], list[int]]  # (accepted nodes, root first; emitted tokens, bonus last)


@dataclass
class VerifyBatch:
    """Inputs of the round's ONE target forward: every row's tree, padded to the widest (N nodes), or with
    fixed shapes to a batch bucket and a node bucket.

    Row b's node j sits at position start_b + depth_j, writes its keys/values at column start_b + j and sees
    the row's committed columns [0, start_b) plus its own ancestors (``capture.tree_mask``). Padding nodes
    and rows write to the scratch column, see only committed columns (a dummy row: column 0) and are never
    read or committed.
    """

    ids: torch.Tensor  # [B, N] int64
    positions: torch.Tensor  # [B, N] int64
    cols: torch.Tensor  # [B, N] int64
    starts: torch.Tensor  # [B] int64, committed columns per row
    anc: torch.Tensor  # [B, N, N] bool, the tree block of the mask
    tables: torch.Tensor  # [B, width + 1] int64, the rows' KV block tables (dummy rows: scratch)
    span: int  # columns attention reads: max_b (start_b + N_b) in whole blocks, or a span bucket
    rows: int  # real rows (the first ``rows`` of the batch)
    nodes: int  # real nodes of the widest tree

    def forward_args(self) -> tuple:
        """The verify forward's inputs, in ``ModelRunner.verify_forward``'s order."""
        return self.ids, self.positions, self.cols, self.starts, self.anc, self.tables, self.span


class Verifier:
    """Verify inputs, heads, acceptance and commit over the model runner's target and cache."""

    def __init__(self, runner: ModelRunner, threshold_single: float, threshold_acc: float) -> None:
        self.runner = runner
        self.threshold_single = threshold_single  # SGLang's thresholds; below 1.0 acceptance is lossy
        self.threshold_acc = threshold_acc

    def first_tokens(self, logits: torch.Tensor, batch: list[Request]) -> list[int]:
        """The first token of each request, straight from the prefill logits [B, V]."""
        roots = logits.argmax(dim=-1).tolist()
        sampled = [i for i, r in enumerate(batch) if not r.params.greedy]
        if sampled:
            probs = filtered_probs(
                logits[sampled][:, None], SamplingTensors.from_params([batch[i].params for i in sampled])
            )[:, 0]  # [S, V]
            coins = torch.stack([torch.rand((), generator=batch[i].generator) for i in sampled])  # [S]
            for i, token in zip(sampled, sample_rows(probs, coins), strict=True):
                roots[i] = token
        return roots

    def inputs(
        self, rows: list[Request], trees: list[DraftTree], shape: tuple[int, int, int] | None = None
    ) -> VerifyBatch:
        """Every row's tree as one padded batch: to the widest tree, or with fixed shapes to the buckets
        that hold the batch (``shape`` = rows, nodes, span forces one, for the warm-up)."""
        sizes = [t.num_nodes for t in trees]
        b, n = len(rows), max(sizes, default=1)
        starts = np.array([r.start for r in rows], dtype=np.int64)  # [B]
        needed = int(max((s + m for s, m in zip(starts, sizes, strict=True)), default=1))
        span = self.runner.span(needed)  # whole blocks, or with fixed shapes a span bucket
        if shape is not None:
            bp, np_, span = shape
        elif self.runner.fixed_shapes:
            bp, np_ = pick(self.runner.batch_buckets, b), pick(self.runner.node_buckets, n)
        else:
            bp, np_ = b, n
        all_starts = np.ones(bp, dtype=np.int64)  # a dummy row sees column 0 (a masked-out row is NaN)
        all_starts[:b] = starts
        ids = np.zeros((bp, np_), dtype=np.int64)
        positions = np.repeat(all_starts[:, None], np_, axis=1)  # [B, N]; padding sits at the root's position
        cols = np.full((bp, np_), self.runner.cache.scratch, dtype=np.int64)  # [B, N]
        anc = np.zeros((bp, np_, np_), dtype=bool)  # [B, N, N]; padding sees committed columns only
        for i, (tree, start, m) in enumerate(zip(trees, starts, sizes, strict=True)):
            tree_ids, tree_positions, tree_anc = tree_verify_inputs(tree, int(start))  # [m], [m], [m, m]
            ids[i, :m], positions[i, :m], anc[i, :m, :m] = tree_ids, tree_positions, tree_anc
            cols[i, :m] = np.arange(start, start + m)
        tensors = self.runner.inputs.load(
            self.runner.fixed_shapes,
            ids=ids,
            positions=positions,
            cols=cols,
            starts=all_starts,
            anc=anc,
            tables=self.runner.block_tables(rows, bp),
        )
        return VerifyBatch(*tensors, span=span, rows=b, nodes=n)

    def greedy_heads(
        self, rows: list[Request], trees: list[DraftTree], hidden: torch.Tensor
    ) -> dict[int, Callable[[int], int]]:
        """For each greedy row i, the target's argmax at its node j, from the final hidden states [B, N, H].

        On an accelerator one head over all greedy rows is one kernel and one transfer. On the CPU the head's
        cost grows with its rows, and the walk usually accepts along the first-child chain (the drafter's
        top token at each depth): those rows of every greedy tree go through the head together, and a node
        off the chain gets its row when the walk reaches it (counted in the accept stage).
        """
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if not greedy:
            return {}
        if self.runner.device.type != "cpu":
            argmax = self.runner.lm_head(hidden[greedy]).argmax(dim=-1).tolist()  # [G, N]
            return {i: argmax[k].__getitem__ for k, i in enumerate(greedy)}
        chains = {i: first_child_chain(trees[i]) for i in greedy}
        row_idx = torch.tensor([i for i in greedy for _ in chains[i]], device=self.runner.device)
        node_idx = torch.tensor([j for i in greedy for j in chains[i]], device=self.runner.device)
        argmax = iter(self.runner.lm_head(hidden[row_idx, node_idx]).argmax(dim=-1).tolist())
        heads = {}
        for i in greedy:
            known = {j: next(argmax) for j in chains[i]}

            def target_token(j: int, known: dict[int, int] = known, i: int = i) -> int:
                if j not in known:
                    known[j] = int(self.runner.lm_head(hidden[i, j : j + 1]).argmax())
                return known[j]

            heads[i] = target_token
        return heads

    def accept(
        self,
        rows: list[Request],
        trees: list[DraftTree],
        greedy_heads: dict[int, Callable[[int], int]],
        sampled: list[int],
        retrieves: dict,
        probs: torch.Tensor | None,
    ) -> list[Verdict]:
        """Per row: (accepted nodes, root first; emitted tokens, bonus last)."""
        verdicts: list = [None] * len(rows)
        for i, head in greedy_heads.items():
            verdicts[i] = follow_verified_tree(trees[i], head)
        if sampled:
            # Each row draws from its own generator, in the same order alone or in a batch.
            coins, finals, device = [], [], self.runner.device
            for i in sampled:
                coins.append(torch.rand(trees[i].num_nodes, generator=rows[i].generator, device=device))
                finals.append(torch.rand((), generator=rows[i].generator, device=device))
            drawn = sample_trees(
                [trees[i] for i in sampled],
                [retrieves[i] for i in sampled],
                probs,
                coins,
                torch.stack(finals),
                threshold_single=self.threshold_single,
                threshold_acc=self.threshold_acc,
            )
            for i, verdict in zip(sampled, drawn, strict=True):
                verdicts[i] = verdict
        return verdicts

    def commit(
        self,
        rows: list[Request],
        verdicts: list[Verdict],
        hidden: torch.Tensor,
        features: torch.Tensor | None,
        tables: torch.Tensor,
    ) -> list[StreamDelta]:
        """Pack every row's accepted keys/values after its committed tokens (``tables``: the round's block
        tables), write its tokens and keep its accepted nodes' drafter features (the engine releases the
        rows that finished)."""
        pack_accepted(self.runner.cache, tables, [r.start for r in rows], [v[0] for v in verdicts])
        deltas = []
        for i, (r, (nodes, tokens)) in enumerate(zip(rows, verdicts, strict=True)):
            logprobs = None
            if r.params.logprobs is not None:
                logprobs = token_logprobs(self.runner.lm_head(hidden[i, nodes]), tokens, r.params.logprobs)
            before = len(r.output.token_ids)
            taken = r.output.write(tokens, logprobs)
            m = len(nodes)
            if r.drafts:  # [N, F * H] -> [m, F * H]; a first-child chain needs no gather
                # Rows that skipped the drafter this round keep their earlier unconsumed features too.
                # A copy: the forward's output buffer is reused by the next round (CUDA graphs).
                r.features.append(features[i, :m].clone() if nodes[-1] == m - 1 else features[i, nodes])
            r.start += m
            r.root = tokens[-1]
            r.stats.acceptance_lengths.append(len(tokens))
            r.stats.decode_tokens += taken
            deltas.append(delta_of(r, before))
        return deltas

    def retrieves(self, trees: list[DraftTree], sampled: list[int]) -> dict[int, object]:
        """Per sampled row with drafts, its tree in SGLang's retrieve format (first child, next sibling)."""
        return {
            i: compile_ddtree_retrieve(trees[i].parents, trees[i].logw) if trees[i].num_nodes > 1 else None
            for i in sampled
        }

    def sampled_probs(self, rows: list[Request], sampled: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The filtered target distributions of the sampled rows' nodes [S, N, V]: sampling reads them all."""
        logits = self.runner.lm_head(hidden[sampled])  # [S, N, V]
        return filtered_probs(logits, SamplingTensors.from_params([rows[i].params for i in sampled]))


def delta_of(r: Request, before: int) -> StreamDelta:
    """What request r's output gained since it held ``before`` tokens."""
    return StreamDelta(
        request_id=r.request_id,
        token_ids=r.output.token_ids[before:],
        text=r.output.new_text(),
        finish_reason=r.output.finish_reason,
        stats=r.stats,
        logprobs=r.output.logprobs[before:],
    )
