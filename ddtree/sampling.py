"""Lossless sampling for tree verification: the target distribution and the tree rejection sampler.

``tree_speculative_sampling_target_only`` is a PyTorch port of the contract of SGLang's sgl_kernel op of the
same name, so a CUDA build can swap the kernel in. With the default thresholds (1, 1) the emitted tokens
are distributed exactly as sampling the target autoregressively: at each node the children are tried in
sibling order with ONE coin against the running sum of their target probabilities (an inverse-CDF draw
restricted to the drafted tokens), and when every child is rejected the bonus token is drawn from the
target with the rejected tokens removed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ddtree.params import SamplingParams, check_accept_thresholds
from ddtree.tree import DraftTree, TreeBatch, TreeRetrieve, top_k_rows
from ddtree.verify import Accepted


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
        host = torch.from_numpy(columns.T.copy())  # [4, B]: one upload per dtype, no Python loop per field
        return cls(
            temperature=host[0].float().to(device, non_blocking=True),
            top_k=host[1].long().to(device, non_blocking=True),
            top_p=host[2].to(device, non_blocking=True),
            min_p=host[3].float().to(device, non_blocking=True),
            max_top_k=max(p.top_k for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
        )


def target_probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One request's distribution over the last dim of ``logits`` [..., V] (see ``filtered_probs``).

    Greedy (temperature 0) has no distribution: take the argmax instead.
    """
    if params.greedy:
        raise ValueError("target_probs_from_logits needs temperature > 0; greedy decoding takes the argmax")
    sampling = SamplingTensors.from_params([params], logits.device)
    return filtered_probs(logits.reshape(1, -1, logits.shape[-1]), sampling).reshape(logits.shape)


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
        rows = max(1, NUCLEUS_CHUNK_ENTRIES // vocab)  # row chunks bound the histograms' scratch memory
        flat = probs.view(b * n, vocab)
        keep = torch.cat(
            [nucleus_mask(flat[i : i + rows], top_p[i : i + rows]) for i in range(0, b * n, rows)]
        ).view(b, n, vocab)
        probs = torch.where(keep, probs, 0.0)  # the min-p floor is relative: no renormalising needed
    if sampling.any_min_p:
        floor = sampling.min_p[:, None, None] * probs.amax(dim=-1, keepdim=True)  # [B, N, 1]
        keep = probs >= floor if not sampling.any_top_p else keep & (probs >= floor)
    return scores.masked_fill(~keep, float("-inf")).softmax(dim=-1)  # HF's final softmax


NUCLEUS_CHUNK_ENTRIES = 1 << 24  # entries per nucleus_mask call: ~0.3 GB of scratch (int32 + float64)


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
    taken (as flashinfer's sampler does). weights [..., V] need not be normalised; coins [...] in [0, 1).
    """
    positive = weights > 0  # [..., V]
    w = torch.where(positive, weights, 0.0)  # [..., V]
    u = coins[..., None] * w.sum(dim=-1, keepdim=True)  # [..., 1]
    hit = (w.cumsum(dim=-1) > u) & positive  # [..., V]
    first = hit.int().argmax(dim=-1)  # [...] argmax returns the first maximum
    vocab = weights.shape[-1]
    last = vocab - 1 - positive.flip(-1).int().argmax(dim=-1)  # [...]
    return torch.where(hit.any(dim=-1), first, torch.where(positive.any(dim=-1), last, -1))


def sample_from_probs(probs: torch.Tensor, coin: float | torch.Tensor) -> int:
    """Plain sampling of one distribution probs [V] with one coin by inverse CDF, with the bonus draw's
    exact rule."""
    coins = torch.as_tensor(coin, dtype=torch.float32).reshape(1).to(probs.device)
    token = int(inverse_cdf(probs.float().reshape(1, -1), coins)[0])
    if token < 0:
        raise ValueError("probs has no positive mass")
    return token


def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """Tree rejection sampling with sgl_kernel's contract; writes predicts, accept_index, accept_token_num.

    Shapes: predicts [bs * N] int32, written at retrive_index slots; accept_index [bs, S] int32 (S = max
    depth + 1, entries past the accepted path untouched); accept_token_num [bs] int32 (accepted draft
    tokens, bonus excluded); candidates, retrive_index, retrive_next_token, retrive_next_sibling
    [bs, N] int64 (node 0 = root); uniform_samples [bs, N] float32; uniform_samples_for_final_sampling
    [bs] float32; target_probs, draft_probs [bs, N, V] float32. draft_probs must come in as zeros: it is
    scratch where rejected tokens' target mass is recorded (mutated).

    Per row, node x's children are tried in sibling order with the coin uniform_samples[row, x]: child c
    with target prob p (under x's row) is accepted iff p > 0 and (coin < running_sum / threshold_acc or
    p >= threshold_single), as in SGLang's current kernel. The test is strict so that, with coins uniform
    on [0, 1), each child is accepted with exactly its probability (``<=`` would also take a child whose
    running sum equals the coin, i.e. the previous sibling's share of [0, 1)). The running sum is float32,
    each partial sum rounded from the exact one. The bonus token after the last accepted node is drawn with
    the final coin from max(target - draft_probs, 0) of that node, or from its plain target row when the
    walk used all S - 1 steps; if rounding leaves that empty, it is the node's last rejected child with
    target mass (V - 1 when there is none), as in the kernel.

    Thresholds take SGLang's whole domain [0, 1] (``threshold_acc`` is floored at 1e-9 like the kernel's
    launcher does, so 0 accepts any child with target mass). The default (1, 1) is lossless; anything
    lower accepts more often and is a deliberately lossy speed option. ``deterministic`` is accepted for
    sgl_kernel's signature; this implementation is always deterministic.

    Vectorised over rows, one step per depth, no host sync: the linked lists become a [bs, N, C] children
    table first (C = N - 1 at most, one gather per sibling rank).
    """
    del deterministic  # every op here is deterministic
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    vocab = target_probs.shape[-1]
    if target_probs.shape != (bs, n, vocab) or draft_probs.shape != target_probs.shape:
        raise ValueError(f"target/draft probs must be [{bs}, {n}, V], got {tuple(target_probs.shape)}")
    if target_probs.dtype != torch.float32 or draft_probs.dtype != torch.float32:
        raise ValueError("target_probs and draft_probs must be float32")
    if any(t.dtype != torch.int32 for t in (predicts, accept_index, accept_token_num)):
        raise ValueError("predicts, accept_index and accept_token_num must be int32")
    device = target_probs.device
    # Children in sibling order: rank 0 is the first child, rank r + 1 the next sibling of rank r.
    ranks = [retrive_next_token.long()]
    for _ in range(n - 2):
        prev = ranks[-1]
        ranks.append(torch.where(prev >= 0, retrive_next_sibling.long().gather(1, prev.clamp(min=0)), -1))
    children = torch.stack(ranks, dim=2) if n > 1 else torch.full((bs, n, 1), -1, device=device)
    rows = torch.arange(bs, device=device)
    walk = _walk_tree(
        children,
        candidates.long(),
        lambda cur: target_probs[rows, cur],
        uniform_samples.float(),
        uniform_samples_for_final_sampling.float().to(device),
        steps,
        threshold_single,
        threshold_acc,
        draft_probs,
    )
    # Node path[t] predicts the token of path[t + 1]; the last accepted node predicts the bonus.
    t = torch.arange(steps, device=device)[None]  # [1, S]
    on_path = t < walk.lengths[:, None]  # [bs, S]
    slots = retrive_index.long().gather(1, walk.path)  # [bs, S]
    # Padding entries rewrite the root's slot with the root's own value: every write is deterministic.
    values = torch.where(on_path, walk.tokens, walk.tokens[:, :1]).to(predicts.dtype)
    predicts[torch.where(on_path, slots, slots[:, :1]).view(-1).to(predicts.device)] = values.view(-1)
    accept_index.copy_(torch.where(on_path, slots.to(accept_index.dtype), accept_index))
    accept_token_num.copy_(walk.lengths - 1)


def sample_tree_batch(
    trees: TreeBatch,
    probs: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
    coins: torch.Tensor,
    final_coins: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> Accepted:
    """Tree rejection sampling of every row of ``trees`` at once (SGLang's contract, as
    ``tree_speculative_sampling_target_only``), on the device with no host sync.

    ``probs`` are the target distributions at the nodes: [B, N, V], or a function from each row's current
    node [B] to its distribution [B, V], so that only the nodes the walk visits (one a depth) are ever
    filtered. ``coins`` [B, N] are each node's coin and ``final_coins`` [B] each row's bonus coin.
    """
    if isinstance(probs, torch.Tensor):
        rows = torch.arange(probs.shape[0], device=probs.device)
        full = probs.float()
        probs = lambda cur: full[rows, cur]  # noqa: E731
    return _walk_tree(
        trees.children(), trees.tokens, probs, coins.float(), final_coins.float(), trees.depth + 1,
        threshold_single, threshold_acc,
    )  # fmt: skip


def _walk_tree(
    children: torch.Tensor,
    candidates: torch.Tensor,
    probs_at: Callable[[torch.Tensor], torch.Tensor],
    coins: torch.Tensor,
    final_coins: torch.Tensor,
    steps: int,
    threshold_single: float,
    threshold_acc: float,
    draft_probs: torch.Tensor | None = None,
) -> Accepted:
    """The rejection walk shared by both entry points: children [B, N, C] (-1 = none, sibling order),
    candidates [B, N] tokens, ``probs_at`` from the current nodes [B] to their target rows [B, V] (asked
    once a step and once for the bonus), coins [B, N], final_coins [B]. ``draft_probs`` [B, N, V], when
    given, records the rejected children's mass (the kernel's scratch) and is subtracted at the last node;
    without it the last node's rejected children are removed directly (the same residual: q - q = 0)."""
    threshold_single, threshold_acc = check_accept_thresholds(threshold_single, threshold_acc)
    b, n = candidates.shape
    device = candidates.device
    acc_scale = max(threshold_acc, 1e-9)
    rows = torch.arange(b, device=device)
    cur = torch.zeros(b, dtype=torch.int64, device=device)
    alive = torch.ones(b, dtype=torch.bool, device=device)
    path = torch.zeros(b, steps, dtype=torch.int64, device=device)
    lengths = torch.ones(b, dtype=torch.int64, device=device)
    ranks = torch.arange(children.shape[2], device=device)

    def tried_children() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """At every row's current node: its target row [B, V], its children [B, C], whether each exists,
        their tokens and their target probs."""
        q = probs_at(cur).float()  # [B, V]
        ch = children[rows, cur]  # [B, C]
        has = ch >= 0
        tokens = torch.where(has, candidates.gather(1, ch.clamp(min=0)), 0)  # [B, C]
        return q, ch, has, tokens, torch.where(has, q.gather(1, tokens), 0.0)  # p: [B, C] float32

    cells, masses = [], []  # rejected children: their cells in draft_probs and their target mass
    for t in range(1, steps):
        _, ch, has, tokens, p = tried_children()
        running = p.double().cumsum(dim=1).float()  # [B, C]
        coin = coins.gather(1, cur[:, None])  # [B, 1]
        hit = has & (p > 0) & ((coin < running / acc_scale) | (p >= threshold_single)) & alive[:, None]
        take = hit.any(dim=1)  # [B]
        first = hit.int().argmax(dim=1)  # [B] the accepted child's rank
        if draft_probs is not None:  # children before the accepted one (all, when none is) were rejected
            rejected = has & alive[:, None] & (ranks[None] < torch.where(take, first, ranks.numel())[:, None])
            vocab = draft_probs.shape[-1]
            cell = (rows[:, None] * n + cur[:, None]) * vocab + tokens  # [B, C] in draft_probs.view(-1)
            cells.append(torch.where(rejected, cell, b * n * vocab))  # the rest: one slot past the end
            masses.append(torch.where(rejected, p, 0.0))
        nxt = ch.gather(1, first[:, None])[:, 0]
        cur = torch.where(take, nxt, cur)
        path[:, t] = torch.where(take, nxt, 0)
        lengths += take
        alive = take
    if cells:  # every (row, node, token) is rejected at most once: one scatter for the whole walk
        scratch = torch.cat((draft_probs.view(-1), draft_probs.new_zeros(1)))
        scratch.scatter_(0, torch.cat(cells, dim=1).view(-1), torch.cat(masses, dim=1).view(-1))
        draft_probs.view(-1).copy_(scratch[:-1])
    # The bonus: the last node's row, less its rejected children unless the walk used every step.
    q, _, has, tokens, p = tried_children()
    vocab = q.shape[-1]
    stopped = lengths < steps  # [B]
    if draft_probs is not None:
        residual = torch.where(stopped[:, None], (q - draft_probs[rows, cur]).clamp_min(0.0), q)
    else:
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
    return Accepted(path=path, tokens=torch.where(at_end, bonus[:, None], emitted), lengths=lengths)


def sample_tree(
    tree: DraftTree,
    retrieve: TreeRetrieve | None,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_coin: float | torch.Tensor,
) -> tuple[list[int], list[int]]:
    """One tree through the kernel contract: target_probs [N, V], coins [N]; returns (nodes, tokens) with
    the root first and the bonus last."""
    n = tree.num_nodes
    if retrieve is None:
        retrieve = TreeRetrieve(torch.full((n,), -1), torch.full((n,), -1))
    steps = int(tree.depths.max()) + 1
    device = target_probs.device
    predicts = torch.zeros(n, dtype=torch.int32, device=device)
    accept_index = torch.full((1, steps), -1, dtype=torch.int32, device=device)
    accept_token_num = torch.zeros(1, dtype=torch.int32, device=device)
    probs = target_probs.float()[None]
    tree_speculative_sampling_target_only(
        predicts,
        accept_index,
        accept_token_num,
        candidates=tree.tokens[None].to(device),
        retrive_index=torch.arange(n, device=device)[None],
        retrive_next_token=retrieve.next_token[None].to(device),
        retrive_next_sibling=retrieve.next_sibling[None].to(device),
        uniform_samples=coins.float().reshape(1, n).to(device),
        uniform_samples_for_final_sampling=torch.as_tensor(final_coin, dtype=torch.float32).reshape(1),
        target_probs=probs,
        draft_probs=torch.zeros_like(probs),
    )
    nodes = [x for x in accept_index[0].tolist() if x >= 0]
    return nodes, predicts[nodes].tolist()
