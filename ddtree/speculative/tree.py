"""DDTree draft-tree construction: the ``budget`` most probable draft prefixes, found best-first.

The drafter gives one distribution per future position (a factorised draft of the next block). Under
that factorisation a prefix's probability is the product of its per-position probabilities, so extending
a prefix or swapping a token for a lower-ranked one never raises it. A best-first heap over rank tuples
therefore pops prefixes in descending probability, and the first ``budget`` pops are exactly the
``budget`` most probable prefixes (among the top-K tokens per position). Every prefix of a popped prefix
was popped earlier, so the popped set is a tree rooted at the last accepted token.

A DFlash2 drafter gives more: a lattice of K candidates per position and, for each candidate, a log-prob
conditioned on the candidate chosen before it (``lattice_tree``). A prefix's score is then the sum of its
edges' log-probs, still never raised by extending the prefix, so the ``budget`` best prefixes are again a
tree, found by the same depth-by-depth beam.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ddtree.model.capture import upload


def draft_candidates(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most probable tokens of every drafted position: log-probs [..., L, k] float32, sorted
    descending, and their ids [..., L, k] int64 (draft_logits [..., L, V]). Both tree builders rank from
    these, so they see the same candidates, ties included."""
    vocab = draft_logits.shape[-1]
    logp = torch.log_softmax(draft_logits.float(), dim=-1).reshape(-1, vocab)  # [rows, V]
    vals, ids = top_k_rows(logp, k)  # [rows, k]
    shape = (*draft_logits.shape[:-1], k)
    return vals.reshape(shape), ids.reshape(shape)


def top_k_rows(x: torch.Tensor, k: int, groups: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1)`` (values and indices, sorted descending) for [L, V], fast when V >> k.

    A top-k over a whole vocabulary is several passes. Instead split each row into V / ``groups``
    strided groups (group j holds entries j, j + V / groups, ...): their maxima are one vectorised
    pass. Every entry above the k-th largest value lies in a group whose maximum is above it, and fewer
    than k groups qualify, so the top k lie in the k groups with the largest maxima, and a top-k over
    those k * ``groups`` entries is exact (up to the order of equal values).
    """
    rows, vocab = x.shape
    if vocab % groups or vocab < 4 * k * groups:  # short rows: one top-k is cheaper
        return x.topk(k, dim=-1)
    cols = vocab // groups
    grid = x.view(rows, groups, cols)  # [L, G, V / G]; entry (g, j) is vocabulary id g * V / G + j
    best = grid.amax(dim=1).topk(k, dim=-1).indices  # [L, k] columns j holding the top k
    cand = grid.gather(2, best[:, None, :].expand(-1, groups, -1)).view(rows, -1)  # [L, G * k]
    values, pos = cand.topk(k, dim=-1)  # [L, k]; pos = g * k + (index into best)
    indices = (pos // k) * cols + best.gather(1, pos % k)  # [L, k] vocabulary ids
    return values, indices


@dataclass
class TreeSpec:
    """What each row of a batch drafts, on the host ([B] int64 each): drafted nodes (0: the root alone),
    branching per depth, and the deepest depth its tree may reach."""

    budgets: np.ndarray
    topks: np.ndarray
    depths: np.ndarray

    def sizes(self, width: int, k: int, lattice: bool = False) -> np.ndarray:
        """Nodes of each row's tree, root included ([B]); known on the host without looking at the
        candidates: the beam keeps ``min(width, valid pairs)`` prefixes a depth whatever their scores
        (``lattice``: every prefix has its own ``min(topk, k)`` children, ``lattice_tree``)."""
        pp, pr = _beam_pairs(width, k)
        count = np.ones(len(self.budgets), dtype=np.int64)  # depth 0: the root
        total = np.zeros_like(count)
        for d in range(int(self.depths.max(initial=0))):
            if lattice:
                live = count * np.minimum(self.topks, k)  # [B]
            else:
                live = ((pp[None] < count[:, None]) & (pr[None] < self.topks[:, None])).sum(axis=1)  # [B]
            count = np.where(d < self.depths, np.minimum(live, width), 0)
            total += count
        return 1 + np.minimum(self.budgets, total)


@dataclass(frozen=True)
class PaddedTrees:
    """A fixed-shape round's trees as its graphs take them: [Bp, Np] (a batch bucket, a node bucket),
    dummy rows with no node at all (``sizes`` 0), so they write only the scratch column."""

    tokens: torch.Tensor  # [Bp, Np] int64
    depths: torch.Tensor  # [Bp, Np] int64
    parents: torch.Tensor  # [Bp, Np] int64
    sizes: torch.Tensor  # [Bp] int64 on the device

    @property
    def valid(self) -> torch.Tensor:
        """[Bp, Np] bool: real nodes."""
        return real_nodes(self.sizes, self.tokens.shape[1])


def real_nodes(sizes: torch.Tensor, n: int) -> torch.Tensor:
    """[B, N] bool: node j of row b is real iff j < sizes[b] (sizes [B] on the device)."""
    return torch.arange(n, device=sizes.device)[None] < sizes[:, None]


@dataclass
class TreeBatch:
    """Every row's tree as [B, N] tensors on the device, in pop order (parents before children); row b's
    nodes past ``sizes[b]`` are padding (token 0, depth 0, parent 0)."""

    tokens: torch.Tensor  # [B, N] int64; column 0 is the root (the row's last committed token)
    depths: torch.Tensor  # [B, N] int64
    parents: torch.Tensor  # [B, N] int64; the root's is -1
    logw: torch.Tensor  # [B, N] float32 cumulative draft log-prob; root 0
    sizes: np.ndarray  # [B] int64 nodes per row, root included (host)
    depth: int  # the deepest node of the batch (host)
    branching: int = 1  # the most children a node may have (host)
    sizes_on_device: torch.Tensor | None = None  # [B] ``sizes`` where the tree builder uploaded them
    padded: PaddedTrees | None = None  # with fixed shapes: the trees as the round's graphs take them

    @functools.cached_property
    def valid(self) -> torch.Tensor:
        """[B, N] bool: real nodes (computed once; every stage of the round reads it)."""
        return real_nodes(self.device_sizes(), self.tokens.shape[1])

    def device_sizes(self) -> torch.Tensor:
        """[B] ``sizes`` on the device (uploaded once)."""
        if self.sizes_on_device is None:
            self.sizes_on_device = upload(self.sizes, self.tokens.device)
        return self.sizes_on_device

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The per-node fields: tokens, depths, parents, logw."""
        return self.tokens, self.depths, self.parents, self.logw

    @classmethod
    def root_only(cls, roots: torch.Tensor) -> TreeBatch:
        """Plain decoding for every row: nothing drafted, only the bonus token (roots [B])."""
        zeros = torch.zeros(roots.shape[0], 1, dtype=torch.int64, device=roots.device)
        sizes = np.ones(roots.shape[0], dtype=np.int64)
        return cls(roots[:, None].to(torch.int64), zeros, zeros - 1, zeros.float(), sizes, 0)

    def read_depth(self) -> TreeBatch:
        """The same trees with ``depth`` the deepest real node, read from the device (one host read).

        The host knows only a bound (the drafted block), and acceptance takes one step per depth; a
        near-flat draft gives wide trees a few levels deep under a bound of 15. The engine reads it after
        launching the verify forward, so on an accelerator the read waits for the tree, not the forward."""
        depth = int(self.depths.max()) if self.depth else 0
        trees = dataclasses.replace(self, depth=depth)
        if "valid" in self.__dict__:
            trees.valid = self.valid
        return trees

    def cut(self, sizes: np.ndarray, nodes: int | None = None) -> TreeBatch:
        """The same trees cut to ``sizes`` nodes (prefixes of pop order are trees), ``nodes`` columns wide
        (by default the largest tree; with fixed shapes, its node bucket)."""
        n = nodes or int(sizes.max(initial=1))
        padded, on_device = None, None
        if self.padded is not None:
            full = np.zeros(self.padded.sizes.shape[0], dtype=np.int64)  # dummy rows: no node
            full[: len(sizes)] = sizes
            p = self.padded
            # contiguous: a graph is compiled for its inputs' strides too
            cols = (x[:, :n].contiguous() for x in (p.tokens, p.depths, p.parents))
            padded = PaddedTrees(*cols, upload(full, p.sizes.device))
            on_device = padded.sizes[: len(sizes)]
        cut = (x[:, :n] for x in self.tensors)
        return TreeBatch(*cut, sizes, min(self.depth, n - 1), self.branching, on_device, padded)


def children_table(parents: torch.Tensor, valid: torch.Tensor, branching: int) -> torch.Tensor:
    """[B, N, C] each node's children in sibling order, -1 past the last, from parents and real nodes
    [B, N] (C = the most children a node may have). Siblings come in node order: in pop order a node's
    children come most probable first, ties by index, which is ``compile_ddtree_retrieve``'s order."""
    b, n = parents.shape
    device = parents.device
    # Each node's rank among its siblings (earlier real nodes with the same parent), then the table.
    nodes = torch.arange(n, device=device)
    same = (parents[:, :, None] == parents[:, None, :]) & (nodes[None, :] < nodes[:, None])
    rank = (same & valid[:, None, :]).sum(dim=2)  # [B, N]
    width = max(1, min(n - 1, branching))
    child = valid & (nodes[None] > 0) & (rank < width)  # every real child fits: rank < branching
    table = torch.full((b, n * width + 1), -1, dtype=torch.int64, device=device)  # last: discarded
    where = torch.where(child, parents.clamp(min=0) * width + rank, n * width)
    table.scatter_(1, where, nodes.expand(b, n))
    return table[:, :-1].view(b, n, width)


def ends_with(
    sequence: tuple[int, ...], history: list[int], tokens: np.ndarray, parents: np.ndarray, node: int
) -> bool:
    """Whether the text up to tree node ``node`` (``history``, the committed output's end with the root
    last, then the node's drafted path) ends with ``sequence``; ``tokens`` / ``parents`` [N] are one tree
    on the host (parents before children, the root's parent -1)."""
    k = len(sequence)
    path, at = [], node
    while at > 0 and len(path) < k:  # the node's drafted path, nearest first
        path.append(int(tokens[at]))
        at = int(parents[at])
    tail = history[max(0, len(history) - (k - len(path))) :] + path[::-1]
    return tuple(tail[-k:]) == sequence if len(tail) >= k else False


@dataclass(frozen=True)
class TreeShape:
    """The beam's static shape: ``width`` survivors a depth, ``k`` ranks a position, ``depths`` levels,
    ``nodes`` columns of the result (root included). The host picks it per round from the rows' specs, or
    per node bucket with fixed shapes (``TreeShape.bucket``), where one compiled graph serves every round
    of that bucket: a wider beam, more ranks or more levels than a round needs change no tree (the rows'
    own budgets, top-k and depths bound what is valid)."""

    width: int
    k: int
    depths: int
    nodes: int

    @classmethod
    def bucket(cls, nodes: int, depths: int, vocab: int) -> TreeShape:
        # a tree of ``nodes`` nodes is at most nodes - 1 deep
        return cls(width=nodes - 1, k=min(nodes - 1, vocab), depths=min(depths, nodes - 1), nodes=nodes)


def build_tree_batch(
    vals: torch.Tensor,
    ids: torch.Tensor,
    roots: torch.Tensor,
    spec: TreeSpec,
    shape: TreeShape | None = None,
    builder: Callable | None = None,
    rows: int | None = None,
) -> TreeBatch:
    """Every row's best-first tree at once, on the device with no host sync: the host prepares the rows'
    sizes and branching, ``beam_tree`` (or ``builder``, its compiled graph for ``shape``) builds the trees.

    ``vals`` / ``ids`` [B, L, K] are each row's candidates (``draft_candidates``; with a ``shape``, K =
    ``shape.k`` and L >= ``shape.depths``), ``roots`` [B] the roots' tokens. Without a ``shape`` the beam
    is as wide, deep and branching as the batch asks and the trees as wide as the largest. With ``rows``
    the rows past it are a fixed shape's dummies: no node at all, and the batch holds the first ``rows``
    (views) with the whole in ``padded``.

    ``vals`` [B, L, K, K] are a DFlash2 lattice's edge log-probs instead (``lattice_tree``, or ``builder``,
    its graph, builds the trees): ``ids`` are its candidates, and ``shape.k`` need only bound a node's
    children (K, or fewer nodes), so a fixed shape's bucket is the marginal beam's.
    """
    b, k, lattice = vals.shape[0], vals.shape[-1], vals.dim() == 4
    device = vals.device
    width = int(spec.budgets.max(initial=0))
    sizes = spec.sizes(width, k, lattice) if width else np.ones(b, dtype=np.int64)
    if rows is not None:
        sizes[rows:] = 0
    if shape is None:
        if int(sizes.max()) == 1:
            return TreeBatch.root_only(roots)
        depth_max = int(spec.depths[spec.budgets > 0].max(initial=0))
        shape = TreeShape(width=width, k=k, depths=depth_max, nodes=int(sizes.max()))
    if (
        (shape.k < min(k, shape.nodes - 1) if lattice else k != shape.k)
        or vals.shape[1] < shape.depths
        or int(sizes.max()) > shape.nodes
        or shape.width < shape.nodes - 1
    ):
        raise ValueError(
            f"candidates {tuple(vals.shape)} or trees of {int(sizes.max())} nodes do not fit {shape}"
        )
    # Branching allowed at each depth ([B, L]: a row's own cap, 0 past its depth), prepared on the host.
    allowed = np.where(np.arange(shape.depths)[None] < spec.depths[:, None], spec.topks[:, None], 0)
    allowed_t, sizes_t = upload(allowed, device), upload(sizes, device)
    if lattice:
        tokens, depths, parents, logw = (builder or lattice_tree)(vals, ids, roots, allowed_t, sizes_t, shape)
    else:
        plan = beam_plan(shape, device)
        tokens, depths, parents, logw = (builder or beam_tree)(vals, ids, roots, allowed_t, sizes_t, plan)
    depth = int(np.minimum(spec.depths, sizes - 1).max())  # a tree of m nodes is at most m - 1 deep
    if rows is None:
        return TreeBatch(tokens, depths, parents, logw, sizes, depth, shape.k, sizes_t)
    padded = PaddedTrees(tokens, depths, parents, sizes_t)
    real = (x[:rows] for x in (tokens, depths, parents, logw))
    return TreeBatch(*real, sizes[:rows], depth, shape.k, sizes_t[:rows], padded)


@dataclass(frozen=True)
class BeamPlan:
    """What the beam reads for a ``TreeShape``, on the device once per shape: each depth's candidate
    pairs (parent slot [P_d], rank [P_d]) and every level entry's depth [T]."""

    shape: TreeShape
    pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    depth_of: torch.Tensor


@functools.cache
def beam_plan(shape: TreeShape, device: torch.device) -> BeamPlan:
    """The pairs are chosen on the host (a boolean mask on the device would sync) and uploaded once."""
    pp, pr = _beam_pairs(shape.width, shape.k)
    pairs, widths, slots = [], [], 1  # the root: one slot
    for _ in range(shape.depths):
        keep = pp < slots
        pairs.append((upload(pp[keep], device), upload(pr[keep], device)))
        slots = min(shape.width, int(keep.sum()))
        widths.append(slots)
    depth_of = upload(np.repeat(np.arange(1, shape.depths + 1), widths), device)
    return BeamPlan(shape, tuple(pairs), depth_of)


def beam_tree(
    vals: torch.Tensor,
    ids: torch.Tensor,
    roots: torch.Tensor,
    allowed: torch.Tensor,
    sizes: torch.Tensor,
    plan: BeamPlan,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trees' tokens, depths, parents and draft log-weights [B, N] (N = ``plan.shape.nodes``): pure
    tensor ops of fixed shapes, one graph per shape when compiled.

    Depth by depth, keep the ``W`` best prefixes among the previous depth's survivors times their K
    children; the best ``sizes_b - 1`` over the union of depths are then row b's tree: each depth's best
    ``budget_b`` are among that depth's W >= budget_b survivors, and the set is prefix-closed because a
    child never scores above its parent. Only candidate pairs (parent slot p, rank r) with
    (p + 1)(r + 1) <= W can make a depth's top W (that many pairs dominate them), so a depth scores
    O(W log W) pairs, not W * K. Scores add in float64, as the heap's Python floats do, and ties fall as the
    heap breaks them: by depth, then rank, then the parent's pop order (a stable sort over pairs laid out
    rank-major, slots in pop order; invalid pairs sort last as NaN). ``allowed`` [B, L] is each row's
    branching per depth (0 past its depth), ``sizes`` [B] its nodes, root included.
    """
    b, device, n, width = vals.shape[0], vals.device, plan.shape.nodes, plan.shape.width
    vals64 = vals.double()
    cost = torch.zeros(b, 1, dtype=torch.float64, device=device)  # -score (NaN: no prefix); the root's 0
    levels = []  # per depth: cost, parent slot, token [B, W_d]
    nan = torch.full((), float("nan"), dtype=torch.float64, device=device)  # a fill: no upload
    for d, (p_d, r_d) in enumerate(plan.pairs):  # [P_d] pairs whose parent slot exists
        cand = cost.index_select(1, p_d) - vals64[:, d].index_select(1, r_d)  # [B, P_d] = -(score + logp)
        cand = torch.where(r_d[None] < allowed[:, d : d + 1], cand, nan)  # NaN: past the row's branching
        order = cand.sort(dim=1, stable=True).indices[:, :width]  # [B, W_d]
        cost, rank = cand.gather(1, order), torch.take(r_d, order)
        levels.append((cost, torch.take(p_d, order), ids[:, d].gather(1, rank)))
    return assemble_tree(levels, plan.depth_of, roots, sizes, n)


def lattice_tree(
    edges: torch.Tensor,
    ids: torch.Tensor,
    roots: torch.Tensor,
    allowed: torch.Tensor,
    sizes: torch.Tensor,
    shape: TreeShape,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``beam_tree`` over a DFlash2 lattice: the trees [B, N] (N = ``shape.nodes``) of the best prefixes
    by the sum of their edges' log-probs, in the same fixed shapes and pure tensor ops.

    ``edges`` [B, L, K, K]: [b, l, p, c] = log q(candidate c at depth l + 1 | candidate p at depth l),
    normalised over c (depth 1's rows all condition on the root alike); ``ids`` [B, L, K] the candidates'
    tokens. A prefix is a path of candidates, one a depth. An edge's log-prob is at most 0, so a child
    never outscores its parent and the beam's argument holds: keeping each depth's ``shape.width`` best
    prefixes among the previous survivors' K children each loses none of the best ``sizes_b - 1``. Every
    parent has its own children, so a depth scores all ``slots x K`` pairs (no pair dominates another
    across parents). ``allowed`` [B, L] caps a node's children by their edge's rank under that parent
    (descending log-prob, ties by candidate index): 1 follows the greedy edge, the lattice's best path.

    Scores add in float64 from the root. Ties fall by depth (shallower first), then within a depth by the
    parent's place in its depth's order, then by candidate index: a stable sort over pairs laid out
    slot-major, slots in pop order (invalid pairs sort last as NaN).
    """
    b, k, device, width = edges.shape[0], edges.shape[-1], edges.device, shape.width
    # Each edge's rank under its parent: the inverse of the parent's stable descending sort.
    by_rank = edges[:, : shape.depths].sort(dim=-1, descending=True, stable=True).indices  # [B, L, K, K]
    ranks = torch.arange(k, device=device).expand_as(by_rank)
    edge_rank = torch.empty_like(by_rank).scatter_(-1, by_rank, ranks)  # [B, L, K, K]
    nan = torch.full((), float("nan"), dtype=torch.float64, device=device)  # a fill: no upload
    # Each edge's cost (-log-prob), NaN past its parent's cap: once for every depth, not per depth.
    capped = edge_rank < allowed[:, : shape.depths, None, None]  # [B, L, K, K]
    edge_cost = torch.where(capped, -edges[:, : shape.depths].double(), nan)  # [B, L, K, K]
    cost = torch.zeros(b, 1, dtype=torch.float64, device=device)  # -score (NaN: no prefix); the root's 0
    cand = torch.zeros(b, 1, dtype=torch.int64, device=device)  # each slot's candidate (the root: any row)
    levels, depth_of = [], []  # per depth: cost, parent slot, token [B, W_d]; depth [W_d]
    for d in range(shape.depths):
        rows = cand[:, :, None].expand(-1, -1, k)  # [B, S, K]: each slot's row of successors
        child = (cost[:, :, None] + edge_cost[:, d].gather(1, rows)).flatten(1)  # [B, S * K], slot-major
        order = child.sort(dim=1, stable=True).indices[:, :width]  # [B, W_d]
        cost, cand = child.gather(1, order), order % k
        levels.append((cost, order // k, ids[:, d].gather(1, cand)))
        depth_of.append(torch.full((order.shape[1],), d + 1, dtype=torch.int64, device=device))
    return assemble_tree(levels, torch.cat(depth_of), roots, sizes, shape.nodes)


def assemble_tree(
    levels: list[tuple[torch.Tensor, ...]],
    depth_of: torch.Tensor,
    roots: torch.Tensor,
    sizes: torch.Tensor,
    n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A beam's trees [B, n] from its levels (per depth: cost (NaN: no prefix), parent slot, token
    [B, W_d], each depth in its pop order; ``depth_of`` [T] every level entry's depth): the best
    ``sizes_b - 1`` entries over the union of depths by cost (ties: the shallower, then the earlier in its
    depth), in pop order."""
    b, device = roots.shape[0], roots.device
    costs = torch.cat([lv[0] for lv in levels], dim=1)  # [B, T] depth-major, each depth in pop order
    order = costs.sort(dim=1, stable=True).indices[:, : n - 1]  # [B, m]
    m = order.shape[1]  # n - 1, or fewer where the beam holds fewer entries (a tiny vocabulary)
    # Global node index of every level entry (1 + its place in pop order; 0 if not in the tree).
    node_of = torch.zeros_like(costs, dtype=torch.int64)
    node_of.scatter_(1, order, torch.arange(1, m + 1, device=device).expand(b, -1))
    widths = [lv[0].shape[1] for lv in levels]
    parents, start = [torch.zeros_like(levels[0][1])], 0  # depth 1's parent is the root
    for (_, slot, _), width_prev in zip(levels[1:], widths, strict=False):
        parents.append(node_of[:, start : start + width_prev].gather(1, slot))
        start += width_prev
    padding = torch.arange(1, m + 1, device=device)[None] >= sizes[:, None]
    node_tokens = torch.cat([lv[2] for lv in levels], dim=1).gather(1, order).masked_fill(padding, 0)
    node_depths = torch.take(depth_of, order).masked_fill(padding, 0)
    node_parents = torch.cat(parents, dim=1).gather(1, order).masked_fill(padding, 0)
    node_logw = (-costs.gather(1, order)).float().masked_fill(padding, 0.0)
    root = torch.zeros(b, 1, dtype=torch.int64, device=device)
    empty = torch.zeros(b, n - 1 - m, dtype=torch.int64, device=device)  # columns no entry reaches
    return (
        torch.cat((roots[:, None].to(torch.int64), node_tokens, empty), dim=1),
        torch.cat((root, node_depths, empty), dim=1),
        torch.cat((root - 1, node_parents, empty), dim=1),
        torch.cat((root.float(), node_logw, empty.float()), dim=1),
    )


@functools.cache
def _beam_pairs(width: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The (parent slot, rank) pairs that can make a depth's top ``width``: (p + 1)(r + 1) <= width, r < k,
    ordered rank-major (the heap's tie order: rank, then the parent's pop order)."""
    pairs = [(p, r) for r in range(min(k, width)) for p in range(width // (r + 1))]
    pp, pr = np.array(pairs, dtype=np.int64).T
    return pp, pr
