"""Checking the proposals: every row's tree as one verify batch, the target's LM heads over its hidden
states, acceptance (one walk: a node is accepted when its token is what the target emits at its parent,
the argmax for greedy rows, the position-keyed sample for sampled ones; SGLang's sibling-order sampler
for lossy thresholds), and the verdicts:
the accepted nodes' KV packed and their drafter features kept on the device, the tokens brought to the host
in one copy. ``Scheduler.update_from_output`` writes them into the requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.request import Request
from ddtree.model.capture import upload
from ddtree.request.logprobs import TokenLogprobs, token_logprobs
from ddtree.request.params import SamplingParams
from ddtree.request.penalties import NodePenalties
from ddtree.speculative.coins import coins_at
from ddtree.speculative.sampling import (
    GRAPH_TOP_K,
    SamplingTensors,
    filtered_probs,
    inverse_cdf,
    sample_tree_batch,
)
from ddtree.speculative.tree import PaddedTrees, TreeBatch
from ddtree.speculative.verify import Accepted, accept_greedy, ancestor_mask, walk_greedy

ARGMAX_CHUNK_ENTRIES = 1 << 24  # logits per LM-head call of the greedy acceptance (64 MB in float32)
SAMPLE_ENTRIES = 1 << 26  # at most this many filtered probabilities at once (256 MB in float32)


@dataclass
class Verdicts:
    """A round's verdicts on the host, one entry per row: the tokens it commits (bonus last), the tree
    nodes they were accepted at (root first), their log-probabilities (rows that asked) and the accepted
    nodes' target features for the row's drafter ([m, F * H]; None for rows without a drafter)."""

    tokens: list[list[int]]
    nodes: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]
    features: list[torch.Tensor | None]


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

    def forward_args(self, features: bool) -> tuple:
        """The verify forward's inputs, in ``ModelRunner.verify``'s order."""
        return self.ids, self.positions, self.cols, self.starts, self.anc, self.tables, self.span, features


class Verifier:
    """Verify inputs, heads, acceptance and commit over the model runner's target and cache.

    From the trees to the verdicts everything stays on the device; ``commit`` copies the round's verdicts
    (tokens, accepted nodes, lengths) to the host in one transfer; ``accept`` reads the trees' depth."""

    def __init__(self, runner: ModelRunner, threshold_single: float, threshold_acc: float) -> None:
        self.runner = runner
        self.shapes = runner.shapes
        self.threshold_single = threshold_single  # SGLang's thresholds; below 1.0 acceptance is lossy
        self.threshold_acc = threshold_acc
        # Lossless thresholds: sampled rows emit the target's position-keyed samples (``coins``); below
        # them, SGLang's sibling-order sampler with each row's generator (its semantics, its coins).
        self.keyed = threshold_single >= 1.0 and threshold_acc >= 1.0

    def first_tokens(self, logits: torch.Tensor, batch: list[Request]) -> list[int]:
        """The first token of each request, straight from the prefill logits [B, V]."""
        if any(r.grammar is not None for r in batch):
            from ddtree.request.grammar import mask_next  # xgrammar: only for engines that serve it

            logits = mask_next(logits, [r.grammar for r in batch])
        if any(r.penalties is not None for r in batch):
            rows = torch.arange(len(batch), device=logits.device)
            penalties = NodePenalties(batch, None, logits.shape[-1], logits.device)
            logits = penalties(logits, rows, torch.zeros_like(rows))
        tokens = logits.argmax(dim=-1)  # [B]
        sampled = [i for i, r in enumerate(batch) if not r.params.greedy]
        if sampled:
            device = logits.device
            sampling = SamplingTensors.from_params([batch[i].params for i in sampled], device)
            probs = filtered_probs(logits[sampled][:, None], sampling)[:, 0]  # [S, V]
            if self.keyed:
                keys, positions = key_positions([batch[i] for i in sampled], device)
                coins = coins_at(keys, positions)  # [S]
            else:
                coins = torch.stack(
                    [torch.rand((), generator=batch[i].generator, device=device) for i in sampled]
                )  # [S]
            at = upload(np.asarray(sampled, dtype=np.int64), device)
            tokens = tokens.index_copy(0, at, inverse_cdf(probs, coins))
        return tokens.tolist()

    def inputs(
        self, rows: list[Request], trees: TreeBatch | None, shape: tuple[int, int, int] | None = None
    ) -> VerifyBatch:
        """Every row's tree as one padded batch: to the widest tree, or with fixed shapes to the buckets
        that hold the batch (``shape`` = rows, nodes, span forces one, for the warm-up with no rows).

        The trees are on the device already: positions, columns and the ancestor block are tensor ops on
        them; the host adds only what it knows (the rows' lengths and block tables)."""
        device = self.runner.device
        b = len(rows)
        sizes = trees.sizes if trees is not None else np.ones(0, dtype=np.int64)
        n = trees.tokens.shape[1] if trees is not None else 1
        starts = np.array([r.start for r in rows], dtype=np.int64)  # [B]
        span = self.shapes.span(int((starts + sizes).max(initial=1)))  # whole blocks, or a span bucket
        if shape is not None:
            bp, np_, span = shape
        else:
            bp, np_ = self.shapes.batch_bucket(b), self.shapes.node_bucket(n)
        all_starts = np.ones(bp, dtype=np.int64)  # a dummy row sees column 0 (a masked-out row is NaN)
        all_starts[:b] = starts
        starts_t = self.shapes.inputs.upload(all_starts)  # [Bp]
        tables = self.shapes.block_tables(rows, bp)
        if trees is not None and trees.padded is not None:  # fixed shapes: the bucket's graph
            scratch, depth = self.runner.cache.scratch, self.shapes.tree_depth(np_)
            ids, positions, cols, anc = self.shapes.inputs_graph(trees.padded, starts_t, scratch, depth)
            tensors = self.shapes.inputs.load(
                True, ids=ids, positions=positions, cols=cols, starts=starts_t, anc=anc, tables=tables
            )
            return VerifyBatch(*tensors, span=span, rows=b, nodes=n)
        ids = torch.zeros(bp, np_, dtype=torch.int64, device=device)
        positions = starts_t[:, None].repeat(1, np_)  # [Bp, Np]; padding sits at the root's position
        cols = torch.full((bp, np_), self.runner.cache.scratch, dtype=torch.int64, device=device)
        anc = torch.zeros(bp, np_, np_, dtype=torch.bool, device=device)  # padding: committed columns only
        if b:
            valid = trees.valid  # [B, N]
            ids[:b, :n] = trees.tokens
            positions[:b, :n] += torch.where(valid, trees.depths, 0)
            nodes = torch.arange(n, device=device)
            cols[:b, :n] = torch.where(valid, starts_t[:b, None] + nodes, self.runner.cache.scratch)
            anc[:b, :n, :n] = ancestor_mask(trees)
        tensors = self.shapes.inputs.load(
            self.shapes.fixed,
            ids=ids,
            positions=positions,
            cols=cols,
            starts=starts_t,
            anc=anc,
            tables=tables,
        )
        return VerifyBatch(*tensors, span=span, rows=b, nodes=n)

    def accept(
        self, rows: list[Request], trees: TreeBatch, hidden: torch.Tensor, padded: torch.Tensor | None = None
    ) -> Accepted:
        """Every row's verdict on the device, from the final hidden states [B, N, H]: a node is accepted
        when its token is what the target emits at its parent: the argmax for greedy rows, for sampled rows
        the sample at the coin of that output position (``coins.coins_at``: the same coin alone, in a
        batch, in any tree), or with lossy thresholds SGLang's tree rejection sampling.

        The LM head runs either over every node at once or, one depth at a time, over each row's current
        node only (``visit_nodes``); both give the same verdicts. With fixed shapes (``padded``: the
        forward's whole output [Bp, Np, H]) a batch of greedy rows or of sampled rows is accepted by its
        bucket's graph (``accept_padded``)."""
        if padded is not None and trees.padded is not None:
            accepted = self.accept_padded(rows, trees, padded)
            if accepted is not None:
                return accepted
        trees = trees.read_depth()  # the round's second host read, while the verify forward runs
        masks = tree_grammar_masks(rows, trees)  # [B, N, W] or None (no structured-output row)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        parts = []
        for group in (greedy, sampled):
            if not group:
                continue
            whole = len(group) == len(rows)
            sub = trees if whole else trees.select(group)
            states = hidden if whole else hidden[group]  # [G, N, H]
            allowed = None if masks is None else masks if whole else masks[group]  # [G, N, W]
            node = NodeLogits(allowed, self._penalties([rows[i] for i in group], sub), sub.tokens.shape[1])
            if group is greedy:
                parts.append((group, self._greedy(sub, states, node)))
            else:
                parts.append((group, self._sample(rows, group, sub, states, node)))
        if len(parts) == 1:
            return parts[0][1]
        b, steps, device = len(rows), trees.depth + 1, hidden.device
        out = Accepted(
            path=torch.zeros(b, steps, dtype=torch.int64, device=device),
            tokens=torch.zeros(b, steps, dtype=torch.int64, device=device),
            lengths=torch.zeros(b, dtype=torch.int64, device=device),
        )
        for group, part in parts:
            at = upload(np.asarray(group, dtype=np.int64), device)
            for name in ("path", "tokens", "lengths"):
                getattr(out, name).index_copy_(0, at, getattr(part, name))
        return out

    def accept_padded(self, rows: list[Request], trees: TreeBatch, hidden: torch.Tensor) -> Accepted | None:
        """The verdicts of a fixed-shape round from its bucket's graph (hidden [Bp, Np, H]), with no host
        read: the walk takes the bucket's depth bound in steps (``RoundShapes.tree_depth``; steps past a
        tree's last level change nothing), and the choice between the head over every node and the walk
        is fixed per bucket. None (the general path) for what a graph does not hold: a mix of greedy and
        sampled rows, grammars, penalties, sampled distributions past ``SAMPLE_ENTRIES``."""
        if any(r.grammar is not None or r.penalties is not None for r in rows):
            return None
        greedy = {r.params.greedy for r in rows}
        if len(greedy) > 1:
            return None
        p, b, device = trees.padded, len(rows), hidden.device
        bp, n = p.tokens.shape
        head = self.runner.lm_head
        if greedy == {True}:
            return Accepted(*self.greedy_padded(p, hidden, trees.branching)).head(b)
        if bp * n * head.weight.shape[0] > SAMPLE_ENTRIES:
            return None
        params = [r.params for r in rows]
        probs = self.padded_probs(params + params[:1] * (bp - b), hidden)  # [Bp, Np, V]
        if probs is None:
            return None
        if self.keyed:
            keys, positions = key_positions(rows, device, bp)
            coins = coins_at(keys[:, None], positions[:, None] + p.depths)  # [Bp, Np]
            return Accepted(*self.shapes.keyed_graph(p, probs, coins, self.shapes.tree_depth(n))).head(b)
        coins, finals = tree_coins(rows, trees.sizes, (bp, n), device)
        return Accepted(*self.sample_padded(p, probs, coins, finals, trees.branching)).head(b)

    def greedy_padded(
        self, trees: PaddedTrees, hidden: torch.Tensor, branching: int
    ) -> tuple[torch.Tensor, ...]:
        """Greedy verdicts of padded trees through their bucket's graph (``verify.greedy_verdicts``)."""
        shapes, head, (bp, n) = self.shapes, self.runner.lm_head, trees.tokens.shape
        depth = shapes.tree_depth(n)
        # All nodes at once (one graph: no chunks) only within ARGMAX_CHUNK_ENTRIES
        walk = self.visit_nodes(bp, n, depth, bp * n * head.weight.shape[0] > ARGMAX_CHUNK_ENTRIES)
        branching = max(1, min(n - 1, branching))  # what the children table holds: one graph a bucket
        return shapes.greedy_graph(hidden, head.weight, head.bias, trees, depth, branching, walk)

    def padded_probs(self, params: list[SamplingParams], hidden: torch.Tensor) -> torch.Tensor | None:
        """The filtered target distributions of a padded batch (``params``: one per row, dummies included;
        hidden [Bp, Np, H]) -> [Bp, Np, V]. With the round compiled, the bucket's graph with every filter on
        (``sampling.sampled_probs``; None past its top-k, for the eager path); eagerly, only the filters some
        row uses."""
        shapes, head = self.shapes, self.runner.lm_head
        sampling = SamplingTensors.from_params(params, hidden.device)
        if not shapes.round_compiled:
            return filtered_probs(head(hidden), sampling)
        if sampling.max_top_k > GRAPH_TOP_K:
            return None
        tensors = (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
        kmax = min(GRAPH_TOP_K, head.weight.shape[0])
        return shapes.filter_graph(hidden, head.weight, head.bias, *tensors, kmax)

    def sample_padded(
        self,
        trees: PaddedTrees,
        probs: torch.Tensor,
        coins: torch.Tensor,
        finals: torch.Tensor,
        branching: int,
    ) -> tuple[torch.Tensor, ...]:
        """Tree rejection sampling of padded trees through their bucket's graph (``sample_verdicts``)."""
        n = trees.tokens.shape[1]
        depth, branching = self.shapes.tree_depth(n), max(1, min(n - 1, branching))
        return self.shapes.sample_graph(
            trees, probs, coins, finals, depth, branching, self.threshold_single, self.threshold_acc
        )

    def visit_nodes(self, g: int, n: int, depth: int, too_big: bool = False) -> bool:
        """Whether the LM head should follow the walk (``depth`` + 1 calls over the G rows' current nodes)
        rather than cover all G x N nodes in one call.

        A head call costs at least ``head_floor_rows`` rows' worth (see ``precision.head_floor_rows``).
        Wide, shallow trees (a near-flat draft) and big budgets favour the walk; small batches of deep
        trees on an accelerator favour one call. ``too_big``: all nodes at once would hold more than the
        caller can (the sampled rows' filtered distributions past ``SAMPLE_ENTRIES``): the walk is taken
        whatever the cost."""
        floor = self.runner.head_floor_rows
        return (depth + 1) * max(g, floor) < max(g * n, floor) or too_big

    def _penalties(self, rows: list[Request], trees: TreeBatch) -> NodePenalties | None:
        if all(r.penalties is None for r in rows):
            return None
        return NodePenalties(rows, trees, self.runner.lm_head.weight.shape[0], trees.tokens.device)

    def _greedy(self, trees: TreeBatch, states: torch.Tensor, node: NodeLogits) -> Accepted:
        """Greedy verdicts of these rows from their hidden states [G, N, H]; ``node`` turns the target's
        logits into the law plain decoding would use there (grammar, penalties)."""
        head = self.runner.lm_head
        if self.visit_nodes(*trees.tokens.shape, trees.depth):
            rows = torch.arange(states.shape[0], device=states.device)
            return walk_greedy(trees, lambda cur: node(head(states[rows, cur]), rows, cur).argmax(dim=-1))
        # All nodes, ARGMAX_CHUNK_ENTRIES // V at a time: at a 152k vocabulary, all of 16 rows x 257 nodes
        # at once would be 2.5 GB of logits.
        flat = states.reshape(-1, states.shape[-1])  # [G * N, H]
        step = max(1, ARGMAX_CHUNK_ENTRIES // head.weight.shape[0])
        argmax = [
            node.flat(head(flat[i : i + step]), i).argmax(dim=-1) for i in range(0, flat.shape[0], step)
        ]
        return accept_greedy(trees, torch.cat(argmax).view(states.shape[:2]))

    def _sample(
        self,
        rows: list[Request],
        group: list[int],
        trees: TreeBatch,
        states: torch.Tensor,
        node: NodeLogits,
    ) -> Accepted:
        """Sampled verdicts of the rows ``group`` (their trees and hidden states [S, N, H]): the keyed walk,
        or with lossy thresholds SGLang's tree rejection sampling; ``node`` turns the target's logits into
        the law plain decoding would sample from there."""
        device = states.device
        head = self.runner.lm_head
        sampling = SamplingTensors.from_params([rows[i].params for i in group], device)
        g, n = trees.tokens.shape
        at = torch.arange(g, device=device)
        if self.visit_nodes(g, n, trees.depth, g * n * head.weight.shape[0] > SAMPLE_ENTRIES):
            probs = lambda cur: filtered_probs(node(head(states[at, cur]), at, cur)[:, None], sampling)[:, 0]  # noqa: E731
        else:
            logits = head(states)  # [S, N, V]
            flat = node.flat(logits.view(-1, logits.shape[-1]), 0)
            probs = filtered_probs(flat.view(logits.shape), sampling)  # [S, N, V]
        if self.keyed:
            keys, positions = key_positions([rows[i] for i in group], device)
            coins = coins_at(keys[:, None], positions[:, None] + trees.depths)  # [S, N]: a node's position
            if callable(probs):
                return walk_greedy(trees, lambda cur: inverse_cdf(probs(cur), coins[at, cur]))
            return accept_greedy(trees, inverse_cdf(probs, coins))
        coins, finals = tree_coins([rows[i] for i in group], trees.sizes, trees.tokens.shape, device)
        return sample_tree_batch(trees, probs, coins, finals, self.threshold_single, self.threshold_acc)

    def pack(self, accepted: Accepted, batch: VerifyBatch) -> None:
        """Move every row's accepted keys/values right after its committed tokens (``batch``: the round's
        block tables and starts). Verdicts a bucket's graph decided move as that bucket's graph, dummy
        rows included (their tables are all scratch); others eagerly. A path of the root alone (plain
        rounds) moves nothing and is skipped."""
        if accepted.path.shape[1] == 1:
            return
        if accepted.bucket is not None:
            whole = accepted.bucket
            self.runner.pack(batch.tables, batch.starts, whole.path, whole.lengths, True)
        else:
            b = accepted.path.shape[0]
            self.runner.pack(batch.tables[:b], batch.starts[:b], accepted.path, accepted.lengths, False)

    def verdicts(
        self,
        rows: list[Request],
        accepted: Accepted,
        hidden: torch.Tensor,
        features: torch.Tensor | None,
        batch: VerifyBatch,
    ) -> Verdicts:
        """Pack every row's accepted keys/values after its committed tokens (``pack``) and keep its accepted
        nodes' drafter features, on the device; then bring the verdicts to the host in one copy, with the
        log-probabilities of the tokens of rows that asked for them."""
        b, steps = accepted.path.shape
        self.pack(accepted, batch)
        kept = None
        if features is not None and any(r.drafts for r in rows):  # [B, S, F * H], a fresh tensor
            kept = features.gather(1, accepted.path[..., None].expand(-1, -1, features.shape[-1]))
        host = torch.cat((accepted.tokens, accepted.path, accepted.lengths[:, None]), dim=1).tolist()
        out = Verdicts([], [], [], [])
        for i, r in enumerate(rows):
            m = host[i][-1]
            tokens, nodes = host[i][:m], host[i][steps : steps + m]
            out.tokens.append(tokens)
            out.nodes.append(nodes)
            want = r.params.logprobs is not None
            out.logprobs.append(
                token_logprobs(self.runner.lm_head(hidden[i, nodes]), tokens, r.params.logprobs)
                if want
                else None
            )
            out.features.append(kept[i, :m] if r.drafts else None)  # [m, F * H]
        return out


def key_positions(rows: list[Request], device: torch.device, width: int = 0) -> tuple[torch.Tensor, ...]:
    """The rows' keys and output lengths (the position their root's successor takes) [max(R, width)]
    int64, padding rows 0, in one upload."""
    host = np.zeros((2, max(len(rows), width)), dtype=np.int64)
    host[0, : len(rows)] = [r.key for r in rows]
    host[1, : len(rows)] = [len(r.output.token_ids) for r in rows]
    both = upload(host, device)
    return both[0], both[1]


def tree_coins(
    rows: list[Request], sizes: np.ndarray, shape: tuple[int, int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's rule (lossy thresholds): each row's coins for its tree's ``sizes[k]`` nodes, then its bonus
    coin, from its own generator (the same draws alone, in a batch, padded or not): [R, N] and [R]
    float32 (``shape`` = R, N; rows past ``rows`` and nodes past a tree: 0)."""
    coins = torch.zeros(shape, dtype=torch.float32, device=device)
    finals = torch.zeros(shape[0], dtype=torch.float32, device=device)
    for k, r in enumerate(rows):
        m = int(sizes[k])
        coins[k, :m] = torch.rand(m, generator=r.generator, device=device)
        finals[k] = torch.rand((), generator=r.generator, device=device)
    return coins, finals


def tree_grammar_masks(rows: list[Request], trees: TreeBatch) -> torch.Tensor | None:
    """[B, N, W] int32: the tokens each node's grammar allows next (every token for rows without
    structured outputs and for padding), or None when no row has a grammar. Its rows' trees come to the
    host in one copy (the round's one extra read, for structured outputs only), where xgrammar walks them."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return None
    device = trees.tokens.device
    grammar = rows[constrained[0]].grammar
    at = upload(np.asarray(constrained, dtype=np.int64), device)
    nodes = np.asarray(torch.stack((trees.tokens, trees.parents), dim=1)[at].cpu())  # [C, 2, N]
    masks = np.full((len(rows), trees.tokens.shape[1], grammar.mask_width), -1, dtype=np.int32)
    for k, i in enumerate(constrained):
        m = int(trees.sizes[i])
        masks[i, :m] = rows[i].grammar.tree_masks(nodes[k, 0, :m], nodes[k, 1, :m])
    return upload(masks, device)


class NodeLogits:
    """What plain decoding would do to the target's logits at a tree node: the grammar's mask
    (``allowed`` [G, N, W], structured outputs) and the penalties, for a group of rows whose trees are
    N nodes wide. Unchanged logits when the group has neither."""

    def __init__(self, allowed: torch.Tensor | None, penalties: NodePenalties | None, width: int) -> None:
        self.allowed = allowed
        self.penalties = penalties
        self.width = width

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """``logits`` [M, V] at the nodes ``nodes`` [M] of rows ``rows`` [M]."""
        if self.allowed is not None:
            from ddtree.request.grammar import apply_masks  # xgrammar: only for engines that serve it

            logits = apply_masks(logits, self.allowed[rows, nodes])
        if self.penalties is not None:
            logits = self.penalties(logits, rows, nodes)
        return logits

    def flat(self, logits: torch.Tensor, first: int) -> torch.Tensor:
        """``logits`` [M, V] of the flat nodes first .. first + M - 1 (row-major over [G, N])."""
        if self.allowed is None and self.penalties is None:
            return logits
        at = torch.arange(first, first + logits.shape[0], device=logits.device)
        return self(logits, at // self.width, at % self.width)
