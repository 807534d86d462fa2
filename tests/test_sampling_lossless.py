"""End-to-end losslessness of sampled decoding: the engine's tokens follow the target's distribution.

A tiny random target over a 6-token vocabulary has its exact law over the next 3 tokens enumerated with
plain forwards and HF's logits warpers (independent of ``ddtree.sampling``). Many seeded ``Engine.generate``
calls with ``ddtree`` and ``dflash`` must pass a chi-square and a G-test against it; the same check must
reject a deliberately biased acceptance rule at the same sample count.

Cost: every neural forward here is a pure function of its inputs and of the KV cache contents, and the
same few prefixes recur across thousands of requests. ``memoise`` therefore replays a forward (outputs and
cache appends) whenever its exact inputs were seen before; the engine still runs its whole loop for every
request. ``test_memoised_models_replay_the_real_ones_exactly`` checks that this changes nothing.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, power_divergence
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import ddtree.engine
import ddtree.sampling
from ddtree.drafter import DFlashDrafter, DraftCache, dflash_config
from ddtree.engine import Engine
from ddtree.params import SamplingParams

VOCAB = 6
PROMPT = [0, 3, 1, 4, 2]
NEW_TOKENS = 3
BUDGET = 4  # < VOCAB: trees cannot hold every continuation, so whole levels get rejected too
TARGET_SEED, TARGET_INIT = 0, 0.3
DRAFTER_SEED, DRAFTER_INIT = 1, 0.5
N_FAST = 3_000
N_SLOW = 20_000
P_PASS = 1e-3
P_BROKEN = 1e-6
BIASED_ACCEPTANCE = 1 / 1.3  # threshold_acc: accept when coin <= 1.3 * running sum

SETTINGS = {
    "T=1": SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS),
    "T=0.7": SamplingParams(temperature=0.7, max_new_tokens=NEW_TOKENS),
    "top-k 3": SamplingParams(temperature=1.0, top_k=3, max_new_tokens=NEW_TOKENS),
    "top-p 0.8": SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=NEW_TOKENS),
}


# --- models --------------------------------------------------------------------------------------------


def build_models() -> tuple[Qwen3ForCausalLM, DFlashDrafter]:
    """Target with peaked-but-not-one-hot next-token laws; drafter with a larger init so trees vary."""
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        initializer_range=TARGET_INIT,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TARGET_SEED)
        target = Qwen3ForCausalLM(config).eval()
        torch.manual_seed(DRAFTER_SEED)
        drafter_config = dflash_config(
            config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, initializer_range=DRAFTER_INIT
        )
        drafter = DFlashDrafter(drafter_config).eval()
    return target, drafter


def _key(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.detach().cpu().numpy().tobytes())


def memoise(target: Qwen3ForCausalLM, drafter: DFlashDrafter) -> None:
    """Replay forwards whose inputs (KV cache contents included) were seen before, appending to the cache.

    The engine runs the target's decoder (``target.model``) and applies the LM head itself, so the decoder is
    what gets memoised.
    """
    decoder = target.get_decoder()
    target_forward, drafter_forward = decoder.forward, drafter.forward
    seen_target: dict = {}
    seen_drafter: dict = {}

    def forward_target(input_ids, attention_mask=None, position_ids=None, cache=None, **kwargs):
        layers = cache.layers
        key = (
            _key(input_ids),
            _key(attention_mask),
            _key(position_ids),
            tuple((_key(layer.keys), _key(layer.values)) for layer in layers)
            if cache.get_seq_length()
            else (),
            tuple(sorted(kwargs.items())),
        )
        if key not in seen_target:
            before = [layer.get_seq_length() for layer in layers]
            out = target_forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                **kwargs,
            )
            appended = [
                (layer.keys[:, :, b:].clone(), layer.values[:, :, b:].clone())
                for layer, b in zip(layers, before, strict=True)
            ]
            hidden = out.last_hidden_state
            outputs = SimpleNamespace(last_hidden_state=hidden, hidden_states=out.hidden_states)
            seen_target[key] = (outputs, appended)
            return seen_target[key][0]
        out, appended = seen_target[key]
        for i, (k, v) in enumerate(appended):
            cache.update(k, v, i)
        return out

    def forward_drafter(block_embeds, features, block_positions, ctx_positions, cache: DraftCache, mask=None):
        layers = range(len(drafter.layers))
        key = (
            _key(block_embeds),
            _key(features),
            _key(block_positions),
            _key(ctx_positions),
            _key(mask),
            tuple((_key(kv[0]), _key(kv[1])) if kv else None for kv in map(cache.cached, layers)),
        )
        if key not in seen_drafter:
            before = cache.length
            out = drafter_forward(block_embeds, features, block_positions, ctx_positions, cache, mask)
            appended = [
                (k[:, :, before:].clone(), v[:, :, before:].clone()) for k, v in map(cache.cached, layers)
            ]
            seen_drafter[key] = (out, appended)
            return out
        out, appended = seen_drafter[key]
        for i, (k, v) in enumerate(appended):
            cache.extend(i, k, v, k.shape[2])
        return out

    decoder.forward = forward_target
    drafter.forward = forward_drafter


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matmuls: a second thread only adds contention (and CI's other core may be busy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def real_models() -> tuple[Qwen3ForCausalLM, DFlashDrafter]:
    return build_models()


@pytest.fixture(scope="module")
def memo_models() -> tuple[Qwen3ForCausalLM, DFlashDrafter]:
    target, drafter = build_models()
    memoise(target, drafter)
    return target, drafter


# --- the exact law of the next 3 tokens ------------------------------------------------------------------


def hf_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p with HF's own warpers (the order of HF generate), then softmax: [B, V]."""
    scores = TemperatureLogitsWarper(params.temperature)(None, logits.double())
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores.softmax(dim=-1)


def assert_filters_have_margin(logits: torch.Tensor, params: SamplingParams, margin: float = 1e-4) -> None:
    """No token sits on a top-k/top-p boundary, so float noise between the engine's cached tree forwards
    and these plain forwards cannot flip which tokens are allowed."""
    scores = logits.double() / params.temperature  # [B, V]
    if params.top_k > 0:
        top = scores.topk(params.top_k + 1, dim=-1).values  # [B, k + 1]
        assert (top[:, -2] - top[:, -1]).min() > margin
    if params.top_p < 1.0:
        cumulative = scores.sort(dim=-1).values.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
        assert (cumulative - (1.0 - params.top_p)).abs().min() > margin


@torch.inference_mode()
def exact_law(target: Qwen3ForCausalLM, params: SamplingParams) -> np.ndarray:
    """p(a, b, c) = p(a) p(b | a) p(c | a, b) over all V^3 continuations, flattened as a * V^2 + b * V + c."""
    prefixes = [
        torch.tensor([PROMPT + list(p) for p in itertools.product(range(VOCAB), repeat=depth)])
        for depth in range(NEW_TOKENS)
    ]  # [V^depth, P + depth] each
    law = torch.ones(1, dtype=torch.float64)
    for ids in prefixes:
        logits = target(input_ids=ids).logits[:, -1]  # [V^depth, V]
        assert_filters_have_margin(logits, params)
        law = (law[:, None] * hf_probs(logits, params)).flatten()  # [V^(depth + 1)]
    return (law / law.sum()).numpy()


# --- sampling through the engine -------------------------------------------------------------------------


@dataclass
class Draws:
    counts: np.ndarray  # [V^3] observed continuations
    rounds: int = 0
    multi_token_rounds: int = 0  # rounds that accepted at least one drafted token
    side_branch_rounds: int = 0  # rounds whose accepted path left the drafter's first choice somewhere


def draw(engine: Engine, method: str, params: SamplingParams, samples: int, seed: int) -> Draws:
    """``samples`` requests seeded seed, seed + 1, ...; counts their 3-token continuations."""
    draws = Draws(counts=np.zeros(VOCAB**NEW_TOKENS, dtype=np.int64))
    sample_tree = ddtree.engine.sample_tree

    def spy(tree, retrieve, *args):
        nodes, tokens = sample_tree(tree, retrieve, *args)
        first_child, parents = retrieve.next_token.tolist(), tree.parents.tolist()
        draws.side_branch_rounds += any(first_child[parents[x]] != x for x in nodes[1:])
        return nodes, tokens

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ddtree.engine, "sample_tree", spy)
        for i in range(samples):
            result = engine.generate(PROMPT, replace(params, seed=seed + i), method=method)
            a, b, c = result.token_ids
            draws.counts[(a * VOCAB + b) * VOCAB + c] += 1
            draws.rounds += result.stats.rounds
            draws.multi_token_rounds += sum(n > 1 for n in result.stats.acceptance_lengths)
    return draws


def fit_p_values(observed: np.ndarray, law: np.ndarray) -> tuple[float, float]:
    """(chi-square p, G-test p) of counts against a law; rare cells pooled until expected >= 5.

    A single draw in a cell the law gives probability 0 is proof of a wrong sampler: both p-values are 0.
    """
    if observed[law == 0].any():
        return 0.0, 0.0
    n = observed.sum()
    expected = law * n
    order = np.argsort(expected, kind="stable")
    order = order[law[order] > 0]
    cut = int((expected[order] < 5.0).sum())  # every rare cell goes to the pool ...
    while 0 < cut < order.size and expected[order[:cut]].sum() < 5.0:  # ... which takes more until >= 5
        cut += 1
    pool, keep = order[:cut], order[cut:]
    obs = np.append(observed[keep], observed[pool].sum()) if cut else observed[keep]
    exp = np.append(expected[keep], expected[pool].sum()) if cut else expected[keep]
    exp = exp * (obs.sum() / exp.sum())  # float rounding only
    chi2 = chisquare(obs, exp).pvalue
    g = power_divergence(obs, exp, lambda_="log-likelihood").pvalue
    return float(chi2), float(g)


def assert_tree_path_exercised(draws: Draws, method: str) -> None:
    """Drafts get accepted and rejected, and ddtree accepts off the drafter's first choice: the verdicts
    come from the tree walk, not just from the bonus draw."""
    assert draws.multi_token_rounds >= 0.15 * draws.rounds
    assert draws.rounds - draws.multi_token_rounds >= 0.05 * draws.rounds
    if method == "ddtree":
        assert draws.side_branch_rounds >= 0.1 * draws.rounds


def biased_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route ``sample_tree`` (the engine's adapter, unchanged) to the kernel with a lossy threshold."""
    kernel = ddtree.sampling.tree_speculative_sampling_target_only
    monkeypatch.setattr(
        ddtree.sampling,
        "tree_speculative_sampling_target_only",
        functools.partial(kernel, threshold_acc=BIASED_ACCEPTANCE),
    )


def sample_and_fit(
    real_models, memo_models, method: str, setting: str, samples: int, seed: int
) -> tuple[Draws, float, float]:
    """Draw through the (memoised) engine and test the counts against the exact law; p-values shown by -rP."""
    params = SETTINGS[setting]
    draws = draw(Engine(*memo_models, budget=BUDGET), method, params, samples, seed)
    chi2_p, g_p = fit_p_values(draws.counts, exact_law(real_models[0], params))
    print(
        f"{method} {setting} n={samples}: chi-square p={chi2_p:.3g} G-test p={g_p:.3g}; "
        f"{draws.multi_token_rounds / draws.rounds:.0%} of {draws.rounds} rounds accepted drafts, "
        f"{draws.side_branch_rounds / draws.rounds:.0%} off the first-choice chain"
    )
    return draws, chi2_p, g_p


# --- tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_fit_accepts_direct_draws_from_the_law_and_rejects_impossible_ones(real_models, setting: str):
    """The statistics alone, no engine: multinomial draws from the enumerated law pass; a draw in a cell
    the law rules out (or a law off by a little) fails."""
    law = exact_law(real_models[0], SETTINGS[setting])
    counts = np.random.default_rng(0).multinomial(N_SLOW, law)
    assert min(fit_p_values(counts, law)) > P_PASS
    last_token = np.arange(law.size) % VOCAB
    tilted = law * np.exp(0.3 * (last_token == law.argmax() % VOCAB))  # favour one last token
    assert max(fit_p_values(counts, tilted / tilted.sum())) < P_BROKEN
    if (law == 0).any():
        counts[np.flatnonzero(law == 0)[0]] += 1
        assert fit_p_values(counts, law) == (0.0, 0.0)


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_memoised_models_replay_the_real_ones_exactly(real_models, memo_models, method: str):
    params = SamplingParams(temperature=1.0, max_new_tokens=2 * NEW_TOKENS)
    runs = []
    for target, drafter in (real_models, memo_models):
        engine = Engine(target, drafter, budget=BUDGET)
        results = [engine.generate(PROMPT, replace(params, seed=i), method=method) for i in range(60)]
        runs.append([(r.token_ids, r.stats.acceptance_lengths) for r in results])
    assert runs[0] == runs[1]


def test_ddtree_samples_follow_target_distribution(real_models, memo_models):
    draws, chi2_p, g_p = sample_and_fit(real_models, memo_models, "ddtree", "T=1", N_FAST, seed=0)
    assert_tree_path_exercised(draws, "ddtree")
    assert chi2_p > P_PASS and g_p > P_PASS, (chi2_p, g_p)


@pytest.mark.parametrize("method", ["ddtree", pytest.param("dflash", marks=pytest.mark.slow)])
def test_biased_acceptance_fails_the_same_distribution_check(real_models, memo_models, monkeypatch, method):
    """Same check, same sample count (and seeds) as the fast test above; the slow tests use more samples,
    which only makes a biased sampler easier to catch."""
    biased_acceptance(monkeypatch)
    _, chi2_p, g_p = sample_and_fit(real_models, memo_models, method, "T=1", N_FAST, seed=0)
    assert chi2_p < P_BROKEN and g_p < P_BROKEN, (chi2_p, g_p)


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_samples_follow_target_distribution_for_every_setting(real_models, memo_models, method, setting):
    draws, chi2_p, g_p = sample_and_fit(real_models, memo_models, method, setting, N_SLOW, seed=1_000_000)
    assert_tree_path_exercised(draws, method)
    assert chi2_p > P_PASS and g_p > P_PASS, (chi2_p, g_p)


@pytest.mark.parametrize("method", ["ddtree", "dflash", "ar"])
def test_seeded_requests_are_reproducible_and_seeds_differ(real_models, method: str):
    engine = Engine(*real_models, budget=BUDGET)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    first = engine.generate(PROMPT, replace(params, seed=7), method=method).token_ids
    assert engine.generate(PROMPT, replace(params, seed=7), method=method).token_ids == first
    others = {
        tuple(engine.generate(PROMPT, replace(params, seed=s), method=method).token_ids) for s in range(8)
    }
    assert len(others) >= 6


@torch.inference_mode()
def greedy_reference(target: Qwen3ForCausalLM, steps: int) -> list[int]:
    ids = list(PROMPT)
    for _ in range(steps):
        ids.append(int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


@pytest.mark.parametrize("method", ["ddtree", "dflash", "ar"])
def test_greedy_is_the_argmax_chain_and_top_k_one_sampling_matches_it(real_models, method: str):
    engine = Engine(*real_models, budget=BUDGET)
    expected = greedy_reference(real_models[0], 12)
    assert engine.generate(PROMPT, SamplingParams(max_new_tokens=12), method=method).token_ids == expected
    for seed in range(3):
        params = SamplingParams(temperature=0.8, top_k=1, seed=seed, max_new_tokens=12)
        assert engine.generate(PROMPT, params, method=method).token_ids == expected
