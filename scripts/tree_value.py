"""Exact expected acceptance of draft trees against the best tree any drafter could give, at temperature.

Under the lossless target-only rule a deterministic tree commits its node n exactly when the target's own
sample passes through it, so a round's expected tokens are 1 + sum over drafted nodes of P_target(prefix),
the product of the target's (filtered, tempered) probabilities along the node's path. That is computed here
with the target's forwards at every parent, no sampling noise: the shipped drafter's best-first tree at
budget B against the oracle tree (the B most probable prefixes under the target's law itself, the ceiling
of any drafter and any tree policy at that budget), and trees built from the draft scores at other
temperatures. Continuations are the target's own seeded samples at each setting (held-out prompts).

Usage: python scripts/tree_value.py [--drafter DIR] [--prompts 12] [--tokens 48] [--every 4] [--budget 16]
       [--draft-temperatures 1.0,1.5]
"""

from __future__ import annotations

import argparse
import heapq

import numpy as np
import torch

from ddtree import Engine, SamplingParams
from ddtree.bench.prompts import load_prompts
from ddtree.model.loader import DEFAULT_DRAFTER, DEFAULT_TARGET, load_drafter, load_target
from ddtree.speculative.dflash2 import DFlash2Drafter
from ddtree.speculative.tree import TreeSpec, build_tree_batch, draft_candidates

SETTINGS = {"T=0": (0.0, 1.0), "T=0.7 top-p 0.95": (0.7, 0.95), "T=1": (1.0, 1.0)}


def law(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The target's sampling law over the vocabulary (vLLM's semantics): [..., V] probabilities."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    p = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1:
        sp, order = p.sort(dim=-1, descending=True)
        drop = (sp.cumsum(-1) - sp) >= top_p  # a token goes once the mass before it reaches top_p
        p = p.scatter(-1, order, sp.masked_fill(drop, 0.0))
        p = p / p.sum(-1, keepdim=True)
    return p


class Target:
    def __init__(self, model) -> None:
        self.model = model

    @torch.no_grad()
    def last_logits(self, seqs: list[list[int]]) -> torch.Tensor:
        """[P, V] the logits after each sequence (right-padded batch: causal, so padding changes nothing)."""
        n = max(map(len, seqs))
        ids = torch.tensor([s + [0] * (n - len(s)) for s in seqs])
        out = self.model(input_ids=ids).logits  # [P, n, V]
        return out[torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])].float()


def tree_value(target: Target, context: list[int], tokens, parents, setting) -> float:
    """Expected committed tokens of one tree: 1 + sum over drafted nodes of P_target(prefix)."""
    n = len(tokens)
    paths = [[] for _ in range(n)]
    for i in range(1, n):
        paths[i] = paths[parents[i]] + [tokens[i]]
    inner = sorted({parents[i] for i in range(1, n)})
    probs = law(target.last_logits([context + paths[j] for j in inner]), *setting)  # [P, V]
    row = {j: k for k, j in enumerate(inner)}
    reach = np.zeros(n)
    reach[0] = 1.0
    for i in range(1, n):
        reach[i] = reach[parents[i]] * float(probs[row[parents[i]], tokens[i]])
    return 1.0 + reach[1:].sum()


def oracle_value(target: Target, context: list[int], budget: int, setting, width: int = 32) -> float:
    """1 + the sum of the ``budget`` largest prefix probabilities under the target's law (best-first:
    a prefix is never likelier than its parent, so popping the frontier's best gives them in order)."""
    heap: list[tuple[float, list[int]]] = []
    top = law(target.last_logits([context]), *setting)[0]
    vals, ids = top.topk(width)
    for v, t in zip(vals.tolist(), ids.tolist(), strict=True):
        if v > 0:
            heapq.heappush(heap, (-v, [t]))
    total = 0.0
    for _ in range(budget):
        if not heap:
            break
        negp, path = heapq.heappop(heap)
        total += -negp
        probs = law(target.last_logits([context + path]), *setting)[0]
        vals, ids = probs.topk(width)
        for v, t in zip(vals.tolist(), ids.tolist(), strict=True):
            if v > 0:
                heapq.heappush(heap, (negp * v, path + [t]))
    return 1.0 + total


@torch.no_grad()
def draft_tree(model, drafter, context: list[int], budget: int, draft_temperature: float):
    """The drafter's best-first tree after ``context`` (its last token the root), as the engine builds it
    (the drafter attends to every context feature, mask None, as in training)."""
    ids = torch.tensor([context])
    hs = model(input_ids=ids[:, :-1], output_hidden_states=True).hidden_states
    features = drafter.select_features(hs)  # [1, C, F * H]
    bs = drafter.block_size
    p = len(context) - 1
    block = torch.tensor([[context[-1]] + [drafter.mask_token_id] * (bs - 1)])
    embed = model.get_input_embeddings()
    hidden = drafter(
        embed(block), features, torch.arange(p, p + bs)[None], torch.arange(p)[None]
    )  # [1, S, H]
    logits = model.get_output_embeddings()(hidden[:, 1:]).float() / draft_temperature  # [1, S - 1, V]
    if isinstance(drafter, DFlash2Drafter):  # the lattice: candidates and edge log-probs [1, L, K, K]
        cand, vals = drafter.lattice(hidden[:, 1:], logits, torch.tensor([context[-1]]))
    else:
        vals, cand = draft_candidates(logits, budget)
    spec = TreeSpec(np.array([budget]), np.array([budget]), np.array([bs - 1]))
    trees = build_tree_batch(vals, cand, torch.tensor([context[-1]]), spec)
    m = int(trees.sizes[0])
    return trees.tokens[0, :m].tolist(), trees.parents[0, :m].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--draft-temperatures", default="1.0,1.5,2.0")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_target(DEFAULT_TARGET)
    drafter = load_drafter(args.drafter).float()
    engine = Engine(model, drafter, tokenizer, method="ar")
    target = Target(model)
    temps = [float(x) for x in args.draft_temperatures.split(",")]
    prompts = [p.text for p in load_prompts("builtin", args.prompts)]
    for name, setting in SETTINGS.items():
        rows: dict[str, list[float]] = {"oracle": [], **{f"drafter@{t:g}": [] for t in temps}}
        for i, prompt in enumerate(prompts):
            sp = SamplingParams(temperature=setting[0], top_p=setting[1], seed=i, max_new_tokens=args.tokens,
                                ignore_eos=True)  # fmt: skip
            prompt_ids = tokenizer(prompt).input_ids
            ids = list(prompt_ids) + list(engine.generate(prompt_ids, sp).token_ids)
            start = len(prompt_ids)
            for p in range(start, len(ids), args.every):
                context = ids[:p]
                rows["oracle"].append(oracle_value(target, context, args.budget, setting))
                for t in temps:
                    tokens, parents = draft_tree(model, drafter, context, args.budget, t)
                    rows[f"drafter@{t:g}"].append(tree_value(target, context, tokens, parents, setting))
        base = np.array(rows[f"drafter@{temps[0]:g}"])
        cells = []
        for k, v in rows.items():  # mean +- sem, and the paired ratio to the first draft temperature's
            v = np.array(v)
            ratio, sem = v.mean() / base.mean(), (v - base).std(ddof=1) / len(v) ** 0.5 / base.mean()
            cells.append(f"{k} {v.mean():.3f}+-{v.std(ddof=1) / len(v) ** 0.5:.3f} ({ratio:.3f}x+-{sem:.3f})")
        print(f"{name} (budget {args.budget}, {len(base)} positions): {'  '.join(cells)}", flush=True)


if __name__ == "__main__":
    main()
