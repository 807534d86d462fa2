"""Oracles: the scalar and full-sort implementations the vectorised library code is held to.

They are the library's first implementations, kept here verbatim apart from one rule made explicit (the
sibling running sum is each exact partial sum rounded to float32, which both sides now use).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import numpy as np
import torch

from ddtree.errors import DDTreeError
from ddtree.request.params import SamplingParams, check_accept_thresholds
from ddtree.sglang import DraftTree, TreeRetrieve, tree_speculative_sampling_target_only
from ddtree.speculative.sampling import SamplingTensors, filtered_probs
from ddtree.speculative.tree import TreeBatch, draft_candidates


def compile_ddtree_retrieve(parents: torch.Tensor, node_logw: torch.Tensor) -> TreeRetrieve:
    """The first-child / next-sibling lists by a scalar sort per node: children by descending logw, ties
    by node index (the oracle of ``ddtree.sglang.compile_ddtree_retrieve``)."""
    if parents.dim() != 1 or node_logw.shape != parents.shape or parents.numel() < 1:
        raise DDTreeError(
            f"parents and node_logw must be equal-length 1-D tensors with a root, got "
            f"{tuple(parents.shape)} and {tuple(node_logw.shape)}"
        )
    par, logw = parents.tolist(), node_logw.tolist()
    n = len(par)
    next_token, next_sibling = [-1] * n, [-1] * n
    for x in range(n):
        kids = sorted((i for i in range(1, n) if par[i] == x), key=lambda i: (-logw[i], i))
        if kids:
            next_token[x] = kids[0]
        for a, b in zip(kids, kids[1:], strict=False):
            next_sibling[a] = b
    device = parents.device
    return TreeRetrieve(torch.tensor(next_token, device=device), torch.tensor(next_sibling, device=device))


def tree_row(trees: TreeBatch, b: int) -> DraftTree:
    """Row b of a batch of device trees as a ``DraftTree`` on the host."""
    m = int(trees.sizes[b])
    return DraftTree(*(x[b, :m].cpu() for x in trees.tensors))


def filtered_probs_reference(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """The filters as one full sort per node (the library's first implementation): [B, N, V] -> [B, N, V].

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


def tree_sampling_reference(
    predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
    retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs, draft_probs,
    threshold_single: float = 1.0, threshold_acc: float = 1.0,
) -> None:  # fmt: skip
    """sgl_kernel's tree rejection sampling as a scalar walk over host lists (the library's first
    implementation), the oracle of the vectorised one: same arguments, same outputs."""
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
            child, exact = first_child[b][cur], 0.0
            while child != -1:
                p = cand_probs[b, child]
                exact += float(p)
                running = np.float32(exact)  # each partial sum rounded from the exact one
                if (p > 0 and coins[b, cur] < running / acc_scale) or p >= single:
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
    bonus = inverse_cdf(residual, uniform_samples_for_final_sampling.float().to(device)).tolist()  # [bs]

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


def build_ddtree_tree(
    draft_logits: torch.Tensor, budget: int, topk: int | None = None, root_token: int = 0
) -> DraftTree:
    """Best-first tree of the ``budget`` most probable prefixes of the drafted block.

    ``draft_logits`` is [L, V]: row d - 1 is the drafter's distribution for the token at depth d.
    ``topk`` bounds the branching per depth (default and maximum: min(budget, V), which loses nothing
    since a node's (budget + 1)-th best child can never be among the ``budget`` best prefixes).
    Outputs are on the CPU. This is the scalar heap, one tree at a time (the library's first builder); the
    engine builds every row's tree at once on the device with ``build_tree_batch``, held to this one.
    """
    k = min(budget if topk is None else topk, budget, draft_logits.shape[1])
    vals, ids = draft_candidates(draft_logits, k)  # [L, k] each
    # One device->host transfer for both: the float32 values travel as their int32 bit patterns.
    host = torch.stack((vals.view(torch.int32), ids.int())).cpu()  # [2, L, k]
    return best_first_tree(host[0].view(torch.float32).tolist(), host[1].tolist(), budget, root_token)


def best_first_tree(
    vals: list[list[float]], ids: list[list[int]], budget: int, root_token: int = 0
) -> DraftTree:
    """The heap: ``budget`` pops over per-depth candidates ``vals`` / ``ids`` ([L][K], sorted descending).

    Scores accumulate in float64 (Python floats); ties pop by (depth, rank, parent's pop index), the heap
    entries' order, which ``build_tree_batch`` reproduces.
    """
    depth_max = len(vals)
    k = len(vals[0]) if vals else 0
    tokens, depths, parents, logw = [root_token], [0], [-1], [0.0]
    pop, push = heapq.heappop, heapq.heappush
    # Entries (-score, depth, rank, parent node): the prefix is parent's prefix + the rank-th token at depth.
    heap: list[tuple[float, int, int, int]] = [(-vals[0][0], 1, 0, 0)] if depth_max > 0 and k else []
    for node in range(1, budget + 1):
        if not heap:
            break
        neg_score, d, r, p = pop(heap)
        tokens.append(ids[d - 1][r])
        depths.append(d)
        parents.append(p)
        logw.append(-neg_score)
        if r + 1 < k:  # next sibling: same parent, next-ranked token
            push(heap, (-(logw[p] + vals[d - 1][r + 1]), d, r + 1, p))
        if d < depth_max:  # first child: best token at the next depth
            push(heap, (-(-neg_score + vals[d][0]), d + 1, 0, node))

    # One host array for the three integer outputs: each torch.tensor(list) call costs as much as the heap
    # spends on tens of nodes.
    ints = torch.from_numpy(np.array((tokens, depths, parents), dtype=np.int64))  # [3, N]
    return DraftTree(
        tokens=ints[0], depths=ints[1], parents=ints[2], logw=torch.tensor(logw, dtype=torch.float32)
    )


def follow_verified_tree(tree: DraftTree, target_token: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """The scalar greedy walk of one tree (the oracle ``accept_greedy`` is tested against).

    ``target_token(i)`` is the target's argmax after the prefix ending at node i; the walk asks only for
    the nodes it accepts. Returns the accepted node indices (root first) and the emitted tokens
    (accepted drafts, then the target's bonus token).
    Nodes come in pop order (every parent before its children), so one scan in index order meets each
    accepted node's children after the node itself; siblings carry distinct tokens, so at most one matches.
    """
    nodes, tokens = [0], [target_token(0)]
    for i, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True)):
        if parent == nodes[-1] and token == tokens[-1]:
            nodes.append(i)
            tokens.append(target_token(i))
    return nodes, tokens


def target_probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One request's distribution over the last dim of ``logits`` [..., V] (see ``filtered_probs``).

    Greedy (temperature 0) has no distribution: take the argmax instead.
    """
    if params.greedy:
        raise ValueError("target_probs_from_logits needs temperature > 0; greedy decoding takes the argmax")
    sampling = SamplingTensors.from_params([params], logits.device)
    return filtered_probs(logits.reshape(1, -1, logits.shape[-1]), sampling).reshape(logits.shape)


def inverse_cdf(weights: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """Per row of weights [R, V] (not normalised; non-positive entries count as 0): the first index whose
    float32 running sum exceeds coin * total, else the last positive index, else -1, by a scalar scan
    (the oracle of ``ddtree.speculative.sampling.inverse_cdf``)."""
    out = []
    for row, coin in zip(weights.float().cpu().numpy(), coins.float().cpu().numpy().reshape(-1), strict=True):
        w = np.where(row > 0, row, np.float32(0))
        total, running, pick, last = np.float32(w.sum(dtype=np.float32)), np.float32(0), -1, -1
        u = np.float32(coin) * total
        for i, x in enumerate(w):
            if x > 0:
                last = i
                running = np.float32(running + x)
                if pick < 0 and running > u:
                    pick = i
        out.append(pick if pick >= 0 else last)
    return torch.tensor(out, dtype=torch.int64, device=weights.device)


def sample_from_probs(probs: torch.Tensor, coin: float | torch.Tensor) -> int:
    """Plain sampling of one distribution probs [V] with one coin by inverse CDF, with the bonus draw's
    exact rule."""
    coins = torch.as_tensor(coin, dtype=torch.float32).reshape(1).to(probs.device)
    token = int(inverse_cdf(probs.float().reshape(1, -1), coins)[0])
    if token < 0:
        raise ValueError("probs has no positive mass")
    return token


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


def assert_bf16_tie(logits: torch.Tensor, picks: list[int], steps: int = 2) -> None:
    """Every token of ``picks`` lies within ``steps`` bf16 steps (at the top logit's magnitude) of the top
    of ``logits`` [V]: two greedy picks that differ only by rounding, not by a different computation."""
    top = logits.max().item()
    step = 2.0 ** (math.floor(math.log2(abs(top))) - 7)  # one bf16 step at the top logit
    for token in picks:
        assert top - logits[token].item() <= steps * step, (token, logits[token].item(), top, step)
