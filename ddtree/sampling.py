"""Lossless sampling for tree verification: the target distribution and the tree rejection sampler.

``tree_speculative_sampling_target_only`` is a PyTorch port of the contract of SGLang's sgl_kernel op of the
same name, so a CUDA build can swap the kernel in. With the default thresholds (1, 1) the emitted tokens
are distributed exactly as sampling the target autoregressively: at each node the children are tried in
sibling order with ONE coin against the running sum of their target probabilities (an inverse-CDF draw
restricted to the drafted tokens), and when every child is rejected the bonus token is drawn from the
target with the rejected tokens removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ddtree.params import SamplingParams, check_accept_thresholds

if TYPE_CHECKING:
    from ddtree.tree import DraftTree, TreeRetrieve


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as [B] tensors (SGLang's ``SamplingBatchInfo``): one filter pass serves a
    batch whose requests each asked for their own temperature / top-k / top-p / min-p."""

    temperature: torch.Tensor  # [B] float32, > 0
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float64 (1 - top_p is taken in double, as HF does), 1.0 = off
    min_p: torch.Tensor  # [B] float32, 0.0 = off

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> SamplingTensors:
        if any(p.greedy for p in params):
            raise ValueError("sampling tensors need temperature > 0; greedy decoding takes the argmax")
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
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

    Order (as HF generate): temperature, top-k, top-p, min-p, then renormalise. Each filter works on the
    logits left by the previous one, exactly as HF's Temperature/TopK/TopP/MinP logits warpers do, so
    ``do_sample=True`` in transformers and this target agree. Top-k keeps every token tied with the k-th
    largest logit; top-p drops the least likely tokens whose total mass is <= 1 - top_p (ties broken by
    vocab index, lower index dropped first) and always keeps the most likely one; min-p drops tokens with
    prob < min_p * max prob. A filter that is off for a row leaves that row alone, and every op works row by
    row, so a request's distribution is the same alone or in any batch.
    """
    scores = logits.float() / sampling.temperature[:, None, None]  # [B, N, V]
    vocab = scores.shape[-1]
    k = sampling.top_k.clamp(max=vocab)  # [B]
    if bool((k > 0).any()):
        top = torch.topk(scores, int(k.max()), dim=-1).values  # [B, N, kmax]
        kth = top.gather(-1, (k - 1).clamp(min=0)[:, None, None].expand(-1, top.shape[1], 1))  # [B, N, 1]
        scores = scores.masked_fill((scores < kth) & (k > 0)[:, None, None], float("-inf"))
    on = sampling.top_p < 1.0  # [B]
    if bool(on.any()):
        ascending, order = torch.sort(scores, dim=-1, stable=True)  # [B, N, V]
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)  # [B, N, V] in sorted order
        keep_mass = (1.0 - sampling.top_p).float()  # [B]
        drop = (cumulative <= keep_mass[:, None, None]) & on[:, None, None]
        drop[..., -1] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if bool((sampling.min_p > 0).any()):
        probs = scores.softmax(dim=-1)  # [B, N, V]
        floor = sampling.min_p[:, None, None] * probs.amax(dim=-1, keepdim=True)  # [B, N, 1]
        scores = scores.masked_fill(probs < floor, float("-inf"))
    return scores.softmax(dim=-1)


def _inverse_cdf(weights: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
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


def sample_rows(probs: torch.Tensor, coins: torch.Tensor) -> list[int]:
    """Plain autoregressive sampling of each row of probs [B, V] with its coin [B] by inverse CDF, with the
    bonus draw's exact rule."""
    tokens = _inverse_cdf(probs.float(), coins.float().to(probs.device)).tolist()  # [B]
    if min(tokens) < 0:
        raise ValueError("probs has no positive mass")
    return tokens


def sample_from_probs(probs: torch.Tensor, coin: float | torch.Tensor) -> int:
    """``sample_rows`` for one distribution probs [V] and one coin."""
    return sample_rows(probs.reshape(1, -1), torch.as_tensor(coin, dtype=torch.float32).reshape(1))[0]


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
    running sum equals the coin, i.e. the previous sibling's share of [0, 1)). The bonus token after the
    last accepted node is drawn with the final coin from max(target - draft_probs, 0) of that node, or
    from its plain target row when the walk used all S - 1 steps; if rounding leaves that empty, it is the
    node's last rejected child with target mass (V - 1 when there is none), as in the kernel.

    Thresholds take SGLang's whole domain [0, 1] (``threshold_acc`` is floored at 1e-9 like the kernel's
    launcher does, so 0 accepts any child with target mass). The default (1, 1) is lossless; anything
    lower accepts more often and is a deliberately lossy speed option.
    """
    threshold_single, threshold_acc = check_accept_thresholds(threshold_single, threshold_acc)
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

    # The walk is sequential and tiny: run it on the host with one transfer per index array.
    cand = candidates.tolist()
    slot = retrive_index.tolist()
    first_child = retrive_next_token.tolist()
    next_sibling = retrive_next_sibling.tolist()
    # Each node's target prob under its parent's row, gathered in one op: [bs, N].
    parent = [[0] * n for _ in range(bs)]
    for b in range(bs):
        for x in range(n):
            c = first_child[b][x]
            while c != -1:
                parent[b][c] = x
                c = next_sibling[b][c]
    row_ids = torch.arange(bs, device=device)  # [bs]
    parent_t = torch.tensor(parent, dtype=torch.int64, device=device)  # [bs, N]
    drafted = candidates.clone()  # [bs, N]
    drafted[:, 0] = 0  # the root's own token is never tried: gather anything in range
    cand_probs = target_probs[row_ids[:, None], parent_t, drafted].cpu().numpy()  # [bs, N] float32
    coins = uniform_samples.float().cpu().numpy()  # [bs, N] float32
    single = np.float32(threshold_single)
    acc_scale = np.float32(max(threshold_acc, 1e-9))

    paths: list[list[int]] = []
    rejected: list[tuple[int, int, int]] = []  # (row, node, token) whose mass leaves the residual
    last_rejected = [-1] * bs
    for b in range(bs):
        path, cur = [0], 0
        for _ in range(1, steps):
            child, running = first_child[b][cur], np.float32(0.0)
            while child != -1:
                p = cand_probs[b, child]
                running = running + p
                if p > 0 and (coins[b, cur] < running / acc_scale or p >= single):
                    break
                rejected.append((b, cur, cand[b][child]))
                if p > 0:
                    last_rejected[b] = cand[b][child]
                child = next_sibling[b][child]
            if child == -1:
                break
            last_rejected[b] = -1  # the fallback is a rejected child of the node the bonus is drawn at
            path.append(child)
            cur = child
        paths.append(path)

    if rejected:
        rb, rn, rt = torch.tensor(rejected, dtype=torch.int64, device=device).unbind(1)
        draft_probs[rb, rn, rt] = target_probs[rb, rn, rt]

    # Bonus draws, vectorised over rows: [bs, V].
    ends = torch.tensor([path[-1] for path in paths], dtype=torch.int64, device=device)  # [bs]
    subtract = torch.tensor([len(path) < steps for path in paths], device=device)  # [bs]
    q = target_probs[row_ids, ends]  # [bs, V]
    residual = torch.where(subtract[:, None], (q - draft_probs[row_ids, ends]).clamp_min(0.0), q)
    bonus = _inverse_cdf(residual, uniform_samples_for_final_sampling.float().to(device)).tolist()  # [bs]

    # Node path[j] predicts the token of path[j + 1]; the last accepted node predicts the bonus.
    slots: list[int] = []
    tokens: list[int] = []
    acc_rows: list[int] = []
    acc_cols: list[int] = []
    for b, path in enumerate(paths):
        if bonus[b] < 0:  # no residual mass left: every token was rejected, up to rounding
            bonus[b] = last_rejected[b] if last_rejected[b] >= 0 else vocab - 1
        slots += [slot[b][x] for x in path]
        tokens += [cand[b][x] for x in path[1:]] + [bonus[b]]
        acc_rows += [b] * len(path)
        acc_cols += range(len(path))
    slots_t = torch.tensor(slots, dtype=torch.int64, device=predicts.device)
    predicts[slots_t] = torch.tensor(tokens, dtype=torch.int32, device=predicts.device)
    accept_index[acc_rows, acc_cols] = slots_t.to(device=accept_index.device, dtype=torch.int32)
    accept_token_num.copy_(torch.tensor([len(path) - 1 for path in paths], dtype=torch.int32))


def sample_trees(
    trees: list[DraftTree],
    retrieves: list[TreeRetrieve | None],
    target_probs: torch.Tensor,
    coins: list[torch.Tensor],
    final_coins: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> list[tuple[list[int], list[int]]]:
    """Verify a batch of trees by rejection sampling, one kernel call for all rows.

    Row b: ``trees[b]`` of N_b nodes, its target distributions ``target_probs[b, :N_b]`` (target_probs is
    [B, N, V] with N >= every N_b; rows past N_b are padding and never read), its per-node coins
    ``coins[b]`` [N_b] and its bonus coin ``final_coins[b]``. Returns per row (accepted nodes from root 0,
    emitted tokens): the accepted draft tokens then the bonus token, so ``len(tokens) == len(nodes)`` and
    node ``nodes[i + 1]`` holds ``tokens[i]`` -- the same shape as the greedy walk.
    """
    device = target_probs.device
    bs, n, _ = target_probs.shape
    final_coins = final_coins.float().to(device)
    if all(tree.num_nodes == 1 for tree in trees):  # plain decoding: the kernel would only draw bonus tokens
        return [([0], [token]) for token in sample_rows(target_probs[:, 0], final_coins)]
    steps = max(int(tree.depths.max()) for tree in trees) + 1
    candidates = torch.zeros(bs, n, dtype=torch.int64)
    next_token = torch.full((bs, n), -1, dtype=torch.int64)  # padding nodes are nobody's children
    next_sibling = torch.full((bs, n), -1, dtype=torch.int64)
    uniform = torch.zeros(bs, n, dtype=torch.float32)
    for b, (tree, retrieve) in enumerate(zip(trees, retrieves, strict=True)):
        m = tree.num_nodes
        candidates[b, :m] = tree.tokens
        uniform[b, :m] = coins[b].float().cpu()
        if retrieve is not None:  # None: a root-only tree, nothing to link
            next_token[b, :m] = retrieve.next_token
            next_sibling[b, :m] = retrieve.next_sibling
    predicts = torch.zeros(bs * n, dtype=torch.int32, device=device)
    accept_index = torch.full((bs, steps), -1, dtype=torch.int32, device=device)
    accept_token_num = torch.zeros(bs, dtype=torch.int32, device=device)
    probs = target_probs.float()  # [B, N, V]
    tree_speculative_sampling_target_only(
        predicts,
        accept_index,
        accept_token_num,
        candidates=candidates.to(device),
        retrive_index=torch.arange(bs * n, device=device).view(bs, n),
        retrive_next_token=next_token.to(device),
        retrive_next_sibling=next_sibling.to(device),
        uniform_samples=uniform.to(device),
        uniform_samples_for_final_sampling=final_coins,
        target_probs=probs,
        draft_probs=torch.zeros_like(probs),
        threshold_single=threshold_single,
        threshold_acc=threshold_acc,
    )
    tokens = predicts.view(bs, n).tolist()
    results = []
    for b, row in enumerate(accept_index.tolist()):
        nodes = [x - b * n for x in row if x >= 0]  # the accepted path fills a prefix; slots are b * n + node
        results.append((nodes, [tokens[b][x] for x in nodes]))
    return results


def sample_tree(
    tree: DraftTree,
    retrieve: TreeRetrieve | None,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_coin: float | torch.Tensor,
) -> tuple[list[int], list[int]]:
    """``sample_trees`` for one tree: target_probs [N, V], coins [N]; returns (nodes, tokens)."""
    final = torch.as_tensor(final_coin, dtype=torch.float32).reshape(1)
    return sample_trees([tree], [retrieve], target_probs[None], [coins], final)[0]
