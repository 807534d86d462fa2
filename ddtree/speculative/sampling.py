"""Lossless sampling for tree verification: the target distribution (``TargetLaw``: what the target emits at
a node, per row) and the two rules ``verify.tree_verdicts`` accepts by.

The engine's rule (``TargetLaw.emit``; the coins in ``ddtree.speculative.coins``): at every node the
target's own token, the argmax for greedy rows and for sampled rows its sample at the coin of the output
position the node predicts, and a node is accepted when its token is its parent's. Lossless by
construction, and a seeded request emits what plain decoding emits with the same seed.

SGLang's rule (``walk_tree``, the contract of sgl_kernel's ``tree_speculative_sampling_target_only``;
``ddtree.sglang`` has it under that signature): at each node the children are tried in sibling order with
ONE coin against the running sum of their target probabilities (an inverse-CDF draw restricted to the
drafted tokens), and when every child is rejected the bonus token is drawn from the target with the
rejected tokens removed. Lossless at its default thresholds (1, 1), but the sample depends on the tree;
the engine runs it only for lossy thresholds below 1, which are SGLang's semantics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from ddtree.model.capture import upload
from ddtree.request.params import SamplingParams
from ddtree.speculative.tree import top_k_rows


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as [B] tensors (SGLang's ``SamplingBatchInfo``): one filter pass serves a
    batch whose requests each asked for their own temperature / top-k / top-p / min-p. Which filters any
    row uses is decided on the host when the batch is built, so filtering never asks the device."""

    temperature: torch.Tensor  # [B] float32, > 0
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float64 (1 - top_p is taken in double, as HF does), 1.0 = off
    min_p: torch.Tensor  # [B] float32, 0.0 = off
    max_top_k: int = 0  # the largest top_k of the batch (0: no row filters by top-k)
    any_top_p: bool = False
    any_min_p: bool = False

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> SamplingTensors:
        if any(p.greedy for p in params):
            raise ValueError("sampling tensors need temperature > 0; greedy decoding takes the argmax")
        columns = np.array([(p.temperature, p.top_k, p.top_p, p.min_p) for p in params], dtype=np.float64)
        cols = upload(columns.T, torch.device(device))  # [4, B]: one pinned upload, cast on the device
        return cls(
            temperature=cols[0].float(),
            top_k=cols[1].long(),  # integers below 2^53: exact in float64
            top_p=cols[2],
            min_p=cols[3].float(),
            max_top_k=max(p.top_k for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
        )

    def take(self, rows: torch.Tensor) -> SamplingTensors:
        """These rows' parameters ([R] indices into this batch's rows; repeats allowed): a row per tree
        node, for filtering the nodes of a ragged batch flattened."""
        return SamplingTensors(
            self.temperature[rows],
            self.top_k[rows],
            self.top_p[rows],
            self.min_p[rows],
            self.max_top_k,
            self.any_top_p,
            self.any_min_p,
        )


def filtered_probs(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """Row b's distribution under row b's parameters: logits [B, N, V] -> float32 probabilities [B, N, V].

    Order (as HF generate): temperature, top-k, top-p, min-p, then renormalise. Each filter works on what
    the previous one left, exactly as HF's Temperature/TopK/TopP/MinP logits warpers do, so
    ``do_sample=True`` in transformers and this target agree. Top-k keeps every token tied with the k-th
    largest logit; top-p drops the least likely tokens whose total mass is <= 1 - top_p (ties broken by
    vocab index, lower index dropped first) and always keeps the most likely one; min-p drops tokens with
    prob < min_p * max prob. A filter that is off for a row leaves that row alone, and every op works row by
    row, so a request's distribution is the same alone or in any batch.

    Nothing sorts the vocabulary: top-k is a partial top-k (``top_k_rows``), top-p finds the nucleus'
    boundary with mass histograms over the probabilities' bits (``nucleus_mask``), min-p is one max; the
    kept scores go through HF's final softmax.
    """
    scores = logits.float() / sampling.temperature[:, None, None]  # [B, N, V]
    b, n, vocab = scores.shape
    if sampling.max_top_k > 0:
        k = sampling.top_k.clamp(max=vocab)  # [B]
        kmax = min(sampling.max_top_k, vocab)
        top = top_k_rows(scores.view(b * n, vocab), kmax)[0].view(b, n, kmax)  # [B, N, kmax] descending
        kth = top.gather(-1, (k - 1).clamp(min=0)[:, None, None].expand(-1, n, 1))  # [B, N, 1]
        scores = scores.masked_fill((scores < kth) & (k > 0)[:, None, None], float("-inf"))
    probs = scores.softmax(dim=-1)  # [B, N, V]
    if not (sampling.any_top_p or sampling.any_min_p):
        return probs
    if sampling.any_top_p:  # rows with top_p = 1 keep every token with mass (nothing is <= 0 but zeros)
        top_p = sampling.top_p[:, None].expand(b, n).reshape(-1)  # [B * N]
        entries = CPU_NUCLEUS_CHUNK_ENTRIES if probs.device.type == "cpu" else NUCLEUS_CHUNK_ENTRIES
        rows = max(1, entries // vocab)  # row chunks bound the histograms' scratch memory
        flat = probs.view(b * n, vocab)
        keep = torch.cat(
            [nucleus_mask(flat[i : i + rows], top_p[i : i + rows]) for i in range(0, b * n, rows)]
        ).view(b, n, vocab)
        probs = torch.where(keep, probs, 0.0)  # the min-p floor is relative: no renormalising needed
    if sampling.any_min_p:
        floor = sampling.min_p[:, None, None] * probs.amax(dim=-1, keepdim=True)  # [B, N, 1]
        keep = probs >= floor if not sampling.any_top_p else keep & (probs >= floor)
    return scores.masked_fill(~keep, float("-inf")).softmax(dim=-1)  # HF's final softmax


GRAPH_TOP_K = 1024  # the largest top-k a bucket's acceptance graph serves (a larger one: the eager call)


@dataclass
class TargetLaw:
    """What the target emits at a tree node, per row of a verify batch ([B] tensors, a padded bucket's
    dummy rows included): the argmax for greedy rows; for sampled rows their filtered distribution
    (``filtered_probs``) sampled at the node's coin. One law serves any mix of greedy and sampled rows,
    as vLLM's rejection sampler serves its batch: greedy rows keep their argmax by a per-row select.

    With ``finals``: SGLang's sibling-order rule (``walk_tree``), ``coins`` each node's coin and
    ``finals`` each row's bonus coin; greedy rows walk a one-hot law at thresholds (1, 1), which accepts
    exactly their argmax. Without: the engine's rule, ``coins`` the position-keyed coins of the nodes'
    outputs."""

    greedy: torch.Tensor  # [B] bool
    sampling: SamplingTensors  # every row's (greedy rows: temperature 1, every filter off), or sampled_rows'
    coins: torch.Tensor  # [B, N] float32
    finals: torch.Tensor | None = None  # [B] float32: SGLang's rule
    threshold_single: float = 1.0
    threshold_acc: float = 1.0
    # [S] int64, eager calls of a batch with greedy rows: only these rows are filtered (at a real vocabulary
    # the filters cost several times the argmax); None (a graph's fixed shapes): every row is
    sampled_rows: torch.Tensor | None = None
    # whether any row may be greedy (host): a bucket's graph serves any mix, so it is True there
    any_greedy: bool = True
    # eager calls over a batch of trees: each row's real nodes, greedy rows 0 ([B] on the host; ``of_trees``).
    # Padding past a sampled row's shorter tree is not filtered: at 16 rows the filters cost ~0.1 ms a node
    # (top-p), and a batch pads every row to its widest tree, so the sampled rows of a mix whose greedy rows
    # draft 8 nodes each filtered 9 nodes for 1.
    tree_sizes: np.ndarray | None = None

    @classmethod
    def of(
        cls,
        params: list[SamplingParams],
        coins: torch.Tensor,
        finals: torch.Tensor | None = None,
        thresholds: tuple[float, float] = (1.0, 1.0),
        every_filter: int = 0,
    ) -> TargetLaw:
        """The law of rows with these ``params`` (one per row of ``coins`` [B, N]). ``every_filter`` > 0
        turns every filter on for every row, top-k that wide (a bucket's graph: one graph for any mix of
        parameters; a row whose filter is off passes it unchanged: top-k 0 masks nothing, top-p 1 drops
        only tokens of probability 0, min-p 0 keeps all). Without it, a batch with greedy rows filters its
        sampled rows only."""
        device = coins.device
        greedy = np.array([p.greedy for p in params], dtype=bool)  # [B]
        rows = None
        if every_filter:
            neutral = SamplingParams(temperature=1.0)
            sampling = SamplingTensors.from_params([neutral if p.greedy else p for p in params], device)
            sampling.max_top_k, sampling.any_top_p, sampling.any_min_p = every_filter, True, True
        else:
            sampling = SamplingTensors.from_params([p for p in params if not p.greedy], device)
            rows = upload(np.flatnonzero(~greedy), device) if greedy.any() else None  # [S]
        any_greedy = bool(greedy.any()) or bool(every_filter)  # a graph's law serves any mix
        return cls(upload(greedy, device), sampling, coins, finals, *thresholds, rows, any_greedy)

    def of_trees(self, params: list[SamplingParams], sizes: np.ndarray) -> TargetLaw:
        """This law (eager, no ``every_filter``) for a batch of trees with ``sizes`` [B] real nodes, padded
        to the width of ``coins`` (N): ``emit_tree`` then filters the sampled rows' real nodes only. Itself
        when no sampled row is padded: gathering their nodes would copy the logits (at V = 151,936 and 16 x
        17 nodes, 165 MB) for nothing, as ``emit`` filters those rows whole."""
        real = np.array([0 if p.greedy else int(m) for p, m in zip(params, sizes, strict=True)])  # [B]
        padded = ((real > 0) & (real < self.coins.shape[1])).any()
        return replace(self, tree_sizes=real) if padded else self

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """SGLang's rule: each row's law at these nodes, logits [B, M, V] -> float32 [B, M, V] (greedy rows:
        one-hot at the argmax)."""
        one_hot = torch.zeros(logits.shape, device=logits.device).scatter_(
            -1, logits.argmax(dim=-1, keepdim=True), 1.0
        )
        rows = self.sampled_rows
        if rows is None:
            return torch.where(self.greedy[:, None, None], one_hot, filtered_probs(logits, self.sampling))
        return one_hot.index_copy(0, rows, filtered_probs(logits[rows], self.sampling))

    def emit_tree(self, logits: torch.Tensor) -> torch.Tensor:
        """The engine's rule over whole trees: the token each row emits at each node, logits [B, N, V] at
        ``coins`` [B, N] -> [B, N] (a sampled row's padding: any token, never read). Only here, where the
        head covers every node at once, are the real nodes looked up (a walk visits real nodes only)."""
        sizes = self.tree_sizes
        if sizes is None:
            return self.emit(logits, self.coins)
        b, n, vocab = logits.shape
        rows = np.flatnonzero(sizes)  # the sampled rows, in ``sampling``'s order
        flat_nodes = np.concatenate([i * n + np.arange(sizes[i]) for i in rows])  # [M] in [B * N]
        order = np.repeat(np.arange(rows.size), sizes[rows])  # [M] each node's row of ``sampling``
        nodes, of_row = upload(np.stack((flat_nodes, order)), logits.device)  # [M] each
        flat = logits.reshape(b * n, vocab)
        probs = filtered_probs(flat[nodes][:, None], self.sampling.take(of_row))[:, 0]  # [M, V]
        sampled = inverse_cdf(probs, self.coins.reshape(-1)[nodes].float())  # [M]
        base = flat.argmax(dim=-1) if self.any_greedy else sampled.new_zeros(b * n)
        return base.index_copy(0, nodes, sampled).view(b, n)

    def emit(self, logits: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
        """The engine's rule: the token each row emits at these nodes, logits [B, M, V] at coins [B, M] ->
        [B, M]."""
        rows = self.sampled_rows
        if rows is None:
            sampled = inverse_cdf(filtered_probs(logits, self.sampling), coins.float())
            if not self.any_greedy:  # an all-sampled batch: no argmax over [B, M, V] to throw away
                return sampled
            return torch.where(self.greedy[:, None], logits.argmax(dim=-1), sampled)
        return logits.argmax(dim=-1).index_copy(
            0, rows, inverse_cdf(filtered_probs(logits[rows], self.sampling), coins[rows].float())
        )


def emitted(logits: torch.Tensor, law: TargetLaw | None, coins: torch.Tensor | None = None) -> torch.Tensor:
    """What plain decoding emits: logits [B, M, V] -> [B, M], every row's argmax (``law`` None: a greedy
    batch, no filter is computed) or each row's ``TargetLaw.emit`` at ``coins`` [B, M]."""
    return logits.argmax(dim=-1) if law is None else law.emit(logits, coins)


NUCLEUS_CHUNK_ENTRIES = 1 << 24  # entries per nucleus_mask call: ~0.3 GB of scratch (int32 + float64)
# On a CPU, fewer: scratch that stays near the core. V = 151,936, one thread, 128 rows at T = 0.7 + top-p
# 0.95: filtered_probs 873 ms at 1 << 24 (110 rows a call), 486 at 1 << 21, 460 at 1 << 20 (6), 463 at 1 << 18
CPU_NUCLEUS_CHUNK_ENTRIES = 1 << 20


def nucleus_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """HF's top-p rule without sorting: keep [R, V] bool for probs [R, V] (float32, rows summing to ~1) and
    top_p [R] (float64).

    HF sorts each row ascending (ties by index), takes the running sum and drops the tokens whose running
    sum is <= 1 - top_p, keeping at least the largest. The dropped tokens are those below one boundary
    value (and, among the tokens equal to it, the lowest indices). The float32 bit patterns of
    non-negative numbers sort as the numbers do, so mass histograms over their bits, most significant
    first, find that value exactly: each level histograms the next ``b`` bits of the entries that share the
    bits found so far (b ~ log2 V, so a level's bins cost no more than the row; two levels at V = 152k).
    Masses add in float64 and are compared rounded to float32, as HF's float32 running sum is. Cost: a few
    passes over [R, V] whatever the distribution's shape (sorting 152k entries per row is about 30 times
    more on the CPU).
    """
    rows, vocab = probs.shape
    device = probs.device
    threshold = (1.0 - top_p).float()[:, None]  # [R, 1] the keep mass HF compares with, in float32
    bits = probs.view(torch.int32)  # [R, V], sign bit 0: 31 significant bits
    mass = probs.double().view(-1)  # [R * V]
    width = min(16, max(8, (vocab - 1).bit_length() - 1))  # bits per level
    row = torch.arange(rows, device=device, dtype=torch.int32)[:, None]  # [R, 1]
    prefix = torch.zeros(rows, 1, dtype=torch.int32, device=device)  # the boundary's bits found so far
    below = torch.zeros(rows, dtype=torch.float64, device=device)  # mass strictly below the prefix' range
    crossed = torch.ones(rows, dtype=torch.bool, device=device)
    shift = 31
    while shift > 0:
        b = min(width, shift)
        shift -= b
        slots = (1 << b) + 2  # slot 0: below the prefix' range, last: above it
        if shift + b == 31:  # the first level: every entry is in range (``>>``: faster than the op)
            index = (bits >> shift) + (1 + row * slots)  # [R, V] slot in the row's histogram
        else:  # the entries outside the prefix' range go to the end slots
            index = ((bits >> shift) - (prefix << b)).clamp_(-1, 1 << b).add_(1 + row * slots)
        hist = torch.zeros(rows * slots, dtype=torch.float64, device=device)
        hist.index_add_(0, index.view(-1), mass)
        cum = hist.view(rows, slots).cumsum(dim=1)  # [R, slots] running mass at each slot's end
        dropped = (cum.float() <= threshold).sum(dim=1)  # [R] slots dropped as a whole
        if shift + b == 31:  # the first level: nothing is above, so all dropped means not crossed
            crossed = dropped < slots
        value = (dropped - 1).clamp(0, (1 << b) - 1)  # [R] the crossing bin
        below = cum.gather(1, value[:, None])[:, 0]  # slots up to the bin's own: everything below it
        prefix = (prefix << b) + value.int()[:, None]
    boundary = torch.where(crossed[:, None], prefix, bits.amax(dim=1, keepdim=True))  # [R, 1]
    # Among the tokens equal to the boundary, HF drops the lowest indices while the running sum stays
    # <= 1 - top_p: `drop` of them (always fewer than all: the largest is kept).
    equal = bits == boundary  # [R, V]
    rank = equal.int().cumsum(dim=1, dtype=torch.int32)  # [R, V] 1-based rank of each tied token by index
    count = rank[:, -1]  # [R]
    tau = boundary[:, 0].view(torch.float32).double()
    limit = threshold[:, 0]
    drop = ((limit.double() - below) / tau).floor().clamp(min=0)
    drop = torch.minimum(drop, (count - 1).double())
    # One step either way puts the float32-rounded running sum on the right side of the threshold.
    drop = drop + (((below + (drop + 1) * tau).float() <= limit) & (drop + 1 <= count - 1)).double()
    drop = drop - (((below + drop * tau).float() > limit) & (drop > 0)).double()
    drop = torch.where(crossed, drop, (count - 1).double()).long()  # [R]
    return (bits > boundary) | (equal & (rank > drop.int()[:, None]))


def inverse_cdf(weights: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """First index whose running sum of positive weights exceeds coin * total; -1 if none is positive.

    When float rounding leaves the running sum at or below coin * total, the last positive index is
    taken (as flashinfer's sampler does). weights [..., V] need not be normalised (no NaN; entries
    <= 0 count as 0); coins [...] in [0, 1).

    A running sum of non-negative weights never decreases (each partial sum rounds a larger exact sum),
    and it rises only at a positive weight, so the first index above coin * total is a binary search
    (``searchsorted``), not a pass over V comparisons and an argmax.
    """
    w = weights.clamp(min=0)  # [..., V]
    total = w.sum(dim=-1, keepdim=True)  # [..., 1]
    running, u = w.cumsum(dim=-1), coins[..., None] * total  # [..., V], [..., 1]
    common = torch.promote_types(running.dtype, u.dtype)  # compared as ``running > u`` would be
    first = torch.searchsorted(running.to(common), u.to(common), right=True)[..., 0]  # [...]
    vocab = weights.shape[-1]
    # the last positive index: sign() is 1 there and 0 elsewhere (float32 holds indices below 2**24)
    index = torch.arange(vocab, device=w.device, dtype=torch.float32)
    last = torch.where(total[..., 0] > 0, (w.sign().float() * index).amax(dim=-1).long(), -1)
    return torch.where(first < vocab, first, last)


def walk_tree(
    children: torch.Tensor,
    candidates: torch.Tensor,
    probs_at: Callable[[torch.Tensor], torch.Tensor],
    coins: torch.Tensor,
    final_coins: torch.Tensor,
    steps: int,
    threshold_single: float | torch.Tensor,
    threshold_acc: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's rejection walk: children [B, N, C] (-1 = none, sibling order), candidates [B, N] tokens,
    ``probs_at`` from the current nodes [B] to their target rows [B, V] (asked once a step and once for
    the bonus), coins [B, N], final_coins [B], thresholds (checked by the caller) as numbers or per row
    [B, 1]. The last node's rejected children are removed from its row directly: the residual
    sgl_kernel draws from, q less their mass q. Path, tokens [B, steps] and lengths [B]."""
    b = candidates.shape[0]
    device = candidates.device
    if isinstance(threshold_acc, torch.Tensor):
        acc_scale = threshold_acc.clamp(min=1e-9)
    else:
        acc_scale = max(threshold_acc, 1e-9)
    rows = torch.arange(b, device=device)
    cur = torch.zeros(b, dtype=torch.int64, device=device)
    alive = torch.ones(b, dtype=torch.bool, device=device)
    path = torch.zeros(b, steps, dtype=torch.int64, device=device)
    lengths = torch.ones(b, dtype=torch.int64, device=device)

    def tried_children() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """At every row's current node: its target row [B, V], its children [B, C], whether each exists,
        their tokens and their target probs."""
        q = probs_at(cur).float()  # [B, V]
        ch = children[rows, cur]  # [B, C]
        has = ch >= 0
        tokens = torch.where(has, candidates.gather(1, ch.clamp(min=0)), 0)  # [B, C]
        return q, ch, has, tokens, torch.where(has, q.gather(1, tokens), 0.0)  # p: [B, C] float32

    for t in range(1, steps):
        _, ch, has, tokens, p = tried_children()
        running = p.double().cumsum(dim=1).float()  # [B, C]
        coin = coins.gather(1, cur[:, None])  # [B, 1]
        # As sgl_kernel: p >= threshold_single alone accepts, so (0, 0) takes any first child, massless too
        hit = has & (((p > 0) & (coin < running / acc_scale)) | (p >= threshold_single)) & alive[:, None]
        take = hit.any(dim=1)  # [B]
        first = hit.int().argmax(dim=1)  # [B] the accepted child's rank
        nxt = ch.gather(1, first[:, None])[:, 0]
        cur = torch.where(take, nxt, cur)
        path[:, t] = torch.where(take, nxt, 0)
        lengths += take
        alive = take
    # The bonus: the last node's row, less its rejected children unless the walk used every step.
    q, _, has, tokens, p = tried_children()
    vocab = q.shape[-1]
    stopped = lengths < steps  # [B]
    gone = torch.zeros(b, vocab + 1, dtype=torch.bool, device=device)
    gone.scatter_(1, torch.where(has & stopped[:, None], tokens, vocab), True)
    residual = torch.where(gone[:, :vocab], 0.0, q)
    bonus = inverse_cdf(residual, final_coins)  # [B], -1 if no mass is left
    # The fallback: the last rejected child with mass (the walk stopped there), else V - 1.
    with_mass = has & (p > 0) & stopped[:, None]
    last = with_mass.shape[1] - 1 - with_mass.flip(1).int().argmax(dim=1)
    fallback = torch.where(with_mass.any(dim=1), tokens.gather(1, last[:, None])[:, 0], vocab - 1)
    bonus = torch.where(bonus >= 0, bonus, fallback)
    # Emitted: the accepted nodes' tokens, then the bonus at position length - 1.
    emitted = candidates.gather(1, torch.cat((path[:, 1:], path[:, :1]), dim=1))  # [B, S]
    at_end = torch.arange(steps, device=device)[None] == (lengths - 1)[:, None]
    return path, torch.where(at_end, bonus[:, None], emitted), lengths
