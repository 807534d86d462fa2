"""Checking the proposals: every row's tree as one verify batch, the target's LM heads over its hidden
states, acceptance (one walk: a node is accepted when its token is what the target emits at its parent,
the argmax for greedy rows, the position-keyed sample for sampled ones; SGLang's sibling-order sampler
for lossy thresholds), and the verdicts:
the accepted nodes' KV packed and their drafter features kept on the device, the tokens brought to the host
in one copy. ``Scheduler.update_from_output`` writes them into the requests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
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
from ddtree.speculative.sampling import GRAPH_TOP_K, TargetLaw, emitted
from ddtree.speculative.tree import PaddedTrees, TreeBatch
from ddtree.speculative.verify import Accepted, ancestor_mask, tree_verdicts

# The most the acceptance takes at once over every node; past it, the LM head follows the walk.
GREEDY_ENTRIES = 1 << 24  # logits (64 MB in float32)
SAMPLE_ENTRIES = 1 << 26  # filtered probabilities (256 MB in float32)


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
    exact: tuple[int, ...] = ()  # rows computed batch-invariantly (``Request.exact``)

    def forward_args(self, features: bool) -> tuple:
        """The verify forward's inputs, in ``ModelRunner.verify``'s order."""
        args = self.ids, self.positions, self.cols, self.starts, self.anc, self.tables, self.span, features
        return (*args, self.exact)


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
        """The first token of each request, straight from the prefill logits [B, V], by the rule that
        accepts tree nodes (``TargetLaw``): the argmax, or the sample at the coin of output position 0."""
        if any(r.grammar is not None for r in batch):
            from ddtree.request.grammar import mask_next  # xgrammar: only for engines that serve it

            logits = mask_next(logits, [r.grammar for r in batch])
        if any(r.penalties is not None for r in batch):
            rows = torch.arange(len(batch), device=logits.device)
            penalties = NodePenalties(batch, None, logits.shape[-1], logits.device)
            logits = penalties(logits, rows, torch.zeros_like(rows))
        law = None
        if not all(r.params.greedy for r in batch):
            device = logits.device
            if self.keyed:
                coins = coins_at(*key_positions(batch, device))  # [B]
            else:  # SGLang's rule: a coin from each sampled row's generator
                zero = torch.zeros((), device=device)
                coins = torch.stack(
                    [
                        zero if r.params.greedy else torch.rand((), generator=r.generator, device=device)
                        for r in batch
                    ]
                )  # [B]
            law = TargetLaw.of([r.params for r in batch], coins[:, None])
        return emitted(logits[:, None], law, None if law is None else law.coins)[:, 0].tolist()

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
            return VerifyBatch(*tensors, span=span, rows=b, nodes=n, exact=exact_rows(rows))
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
        return VerifyBatch(*tensors, span=span, rows=b, nodes=n, exact=exact_rows(rows))

    def accept(
        self, rows: list[Request], trees: TreeBatch, hidden: torch.Tensor, padded: torch.Tensor | None = None
    ) -> Accepted:
        """Every row's verdict on the device, from the final hidden states [B, N, H], by the one acceptance
        (``verify.tree_verdicts``): a node is accepted when its token is what the target emits at its
        parent, the argmax for greedy rows, for sampled rows the sample at the coin of that output position
        (``coins.coins_at``: the same coin alone, in a batch, in any tree), or with lossy thresholds
        SGLang's tree rejection sampling.

        With fixed shapes (``padded``: the forward's whole output [Bp, Np, H]) the bucket's trees go
        through its graph, the depth bound fixed by the bucket, with no host read. What a graph does not
        hold (structured outputs, penalties, a top-k past ``GRAPH_TOP_K``), and every round without fixed
        shapes, runs the same function eagerly over exactly the batch ([B, N]), its steps the trees' depth
        (the round's second host read, while the verify forward runs)."""
        node = self.node_logits(rows, trees)
        too_wide = self.shapes.round_compiled and max((r.params.top_k for r in rows), default=0) > GRAPH_TOP_K
        exact = self.runner.exact_rows(exact_rows(rows), len(rows))
        # What a bucket's graph does not hold; exact rows' head runs under a mode (``InvariantLinear``),
        # which an uncompiled bucket function takes as it is
        eager = node is not None or too_wide or (exact is not None and self.shapes.round_compiled)
        graph = padded is not None and trees.padded is not None and not eager
        if graph:
            p, states, accept = trees.padded, padded, self.shapes.accept_graph
            depth = self.shapes.tree_depth(p.tokens.shape[1])
        else:
            trees = trees.read_depth()
            p = PaddedTrees(trees.tokens, trees.depths, trees.parents, trees.device_sizes())
            states, accept, depth = hidden, tree_verdicts, trees.depth
        law = self.law(rows, trees.sizes, p, graph)
        with exact.linear() if exact is not None else contextlib.nullcontext():
            accepted = self.decide(accept, p, states, law, depth, trees.branching, node)  # the LM head
        return accepted.head(len(rows)) if graph else accepted

    def decide(
        self,
        accept: Callable,
        trees: PaddedTrees,
        hidden: torch.Tensor,
        law: TargetLaw | None,
        depth: int,
        branching: int,
        node: NodeLogits | None = None,
    ) -> Accepted:
        """``accept`` (``tree_verdicts``, or a bucket's graph of it) over trees [G, N] and their hidden
        states [G, N, H], choosing the LM head's way (``visit_nodes``) and the children table's width:
        both fixed per bucket, so one graph a bucket and law kind."""
        g, n = trees.tokens.shape
        head = self.runner.lm_head
        too_big = g * n * head.weight.shape[0] > (GREEDY_ENTRIES if law is None else SAMPLE_ENTRIES)
        walk = self.visit_nodes(g, n, depth, too_big)
        branching = max(1, min(n - 1, branching))  # what the children table holds
        return Accepted(*accept(hidden, head.weight, head.bias, trees, law, depth, branching, walk, node))

    def law(
        self, rows: list[Request], sizes: np.ndarray, trees: PaddedTrees, graph: bool
    ) -> TargetLaw | None:
        """What the target emits at each node of these trees ([Bp, Np]; rows past ``rows``: dummies,
        greedy), or None when every row is greedy: the rows' sampling parameters and their coins, the
        position-keyed ones or, with lossy thresholds, SGLang's from each sampled row's generator
        (``sizes``: each row's nodes, on the host). ``graph``: for a bucket's graph (``law_of``)."""
        if all(r.params.greedy for r in rows):
            return None
        device = trees.tokens.device
        bp, n = trees.tokens.shape
        params = [r.params for r in rows] + [SamplingParams()] * (bp - len(rows))
        if self.keyed:
            keys, positions = key_positions(rows, device, bp)
            coins = coins_at(keys[:, None], positions[:, None] + trees.depths)  # [Bp, Np]: a node's position
            law = self.law_of(params, coins, None, graph)
            return law if graph else law.of_trees(params, sizes)
        coins, finals = tree_coins(rows, sizes, (bp, n), device)
        return self.law_of(params, coins, finals, graph)

    def law_of(
        self, params: list[SamplingParams], coins: torch.Tensor, finals: torch.Tensor | None, graph: bool
    ) -> TargetLaw:
        """The law of rows with these parameters and coins ([B, N]; ``finals`` [B]: SGLang's rule) at this
        verifier's thresholds. For a compiled bucket's graph (``graph``) every filter is on for every row,
        so one graph serves any mix (``TargetLaw.of``); the warm-up builds its dummy law here too."""
        every = (
            min(GRAPH_TOP_K, self.runner.lm_head.weight.shape[0])
            if graph and self.shapes.round_compiled
            else 0
        )
        return TargetLaw.of(params, coins, finals, (self.threshold_single, self.threshold_acc), every)

    def visit_nodes(self, g: int, n: int, depth: int, too_big: bool = False) -> bool:
        """Whether the LM head should follow the walk (``depth`` + 1 calls over the G rows' current nodes)
        rather than cover all G x N nodes in one call.

        A head call costs at least ``head_floor_rows`` rows' worth (see ``precision.head_floor_rows``).
        Wide, shallow trees (a near-flat draft) and big budgets favour the walk; small batches of deep
        trees on an accelerator favour one call. ``too_big``: all nodes at once would hold more logits
        (``GREEDY_ENTRIES``) or filtered probabilities (``SAMPLE_ENTRIES``) than the acceptance takes at
        once: the walk is taken whatever the cost."""
        floor = self.runner.head_floor_rows
        return (depth + 1) * max(g, floor) < max(g * n, floor) or too_big

    def node_logits(self, rows: list[Request], trees: TreeBatch) -> NodeLogits | None:
        """What plain decoding does to the target's logits at these rows' nodes (grammar masks, penalties),
        or None when no row has either."""
        masks = tree_grammar_masks(rows, trees)  # [B, N, W] or None (no structured-output row)
        penalties = None
        if any(r.penalties is not None for r in rows):
            penalties = NodePenalties(rows, trees, self.runner.lm_head.weight.shape[0], trees.tokens.device)
        return None if masks is None and penalties is None else NodeLogits(masks, penalties)

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


def exact_rows(rows: list[Request]) -> tuple[int, ...]:
    """The batch indices of the rows computed batch-invariantly (``Request.exact``)."""
    return tuple(i for i, r in enumerate(rows) if r.exact)


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
    """SGLang's rule (lossy thresholds): each sampled row's coins for its tree's ``sizes[k]`` nodes, then
    its bonus coin, from its own generator (the same draws alone, in a batch, padded or not): [R, N] and
    [R] float32 (``shape`` = R, N; greedy rows, rows past ``rows`` and nodes past a tree: 0)."""
    coins = torch.zeros(shape, dtype=torch.float32, device=device)
    finals = torch.zeros(shape[0], dtype=torch.float32, device=device)
    for k, r in enumerate(rows):
        if r.params.greedy:
            continue
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
    (``allowed`` [B, N, W], structured outputs) and the penalties, for rows whose trees are N nodes wide."""

    def __init__(self, allowed: torch.Tensor | None, penalties: NodePenalties | None) -> None:
        self.allowed = allowed
        self.penalties = penalties

    def __call__(self, logits: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """``logits`` [B, M, V] at each row's nodes ``nodes`` [B, M]."""
        b, m, vocab = logits.shape
        rows = torch.arange(b, device=logits.device)[:, None].expand(b, m).reshape(-1)  # [B * M]
        at, flat = nodes.reshape(-1), logits.reshape(-1, vocab)
        if self.allowed is not None:
            from ddtree.request.grammar import apply_masks  # xgrammar: only for engines that serve it

            flat = apply_masks(flat, self.allowed[rows, at])
        if self.penalties is not None:
            flat = self.penalties(flat, rows, at)
        return flat.view(b, m, vocab)
