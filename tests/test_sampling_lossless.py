"""End-to-end losslessness of sampled decoding: the engine's tokens follow the target's distribution.

A tiny random target over a 6-token vocabulary has its exact law over the next 3 tokens enumerated with
plain forwards and HF's logits warpers (independent of ``ddtree.speculative.sampling``). Many seeded
``Engine.generate`` calls with ``ddtree`` and ``dflash`` must pass a chi-square and a G-test against it; the
same check must
reject a deliberately biased acceptance rule at the same sample count.

The requests are decoded in continuously batched runs: every counted request shares its rounds with other
counted requests (other seeds) and with companions of other methods, prompt lengths and sampling settings,
so the check covers the batched round (padding, per-row parameters and generators) as a user runs it.
"""

from __future__ import annotations

import copy
import itertools
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, power_divergence
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import ddtree.engine.verifier as verifier_module
from ddtree.engine import Engine
from ddtree.engine.verifier import Verifier
from ddtree.request.params import SamplingParams
from ddtree.speculative import coins
from ddtree.speculative.budget import CostModel, LinearCost
from ddtree.speculative.drafter import DFlashDrafter, dflash_config

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
BIASED_ACCEPTANCE = 1 / 1.3  # threshold_acc: accept when coin < 1.3 * running sum
BATCH = 128  # requests in flight while drawing (fewer rounds for the same samples: the suite's slowest file)
SMALL_BATCH = 32  # where the batch shapes the test: budget auto's cost model, the compiled batch bucket

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


def build_mla_models() -> tuple[DeepseekV3ForCausalLM, DFlashDrafter]:
    """An MLA + MoE target (DeepSeek-V3's layout: q_lora, YaRN, interleaved rope, 2 routing groups, a dense
    layer 0) over the same 6-token vocabulary, and a drafter for it (``dflash_config``'s GQA heads)."""
    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
        ),
        max_position_embeddings=64,
        initializer_range=TARGET_INIT,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TARGET_SEED)
        target = DeepseekV3ForCausalLM(config).eval()
        torch.manual_seed(DRAFTER_SEED)
        drafter_config = dflash_config(
            config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, initializer_range=DRAFTER_INIT
        )
        drafter = DFlashDrafter(drafter_config).eval()
    return target, drafter


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
def mla_models() -> tuple[DeepseekV3ForCausalLM, DFlashDrafter]:
    return build_mla_models()


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
        logits = target(input_ids=ids.to(target.device)).logits[:, -1].cpu()  # [V^depth, V]
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
    sizes: Counter = field(default_factory=Counter)  # drafted nodes verified per round -> rounds


def draw(engine: Engine, method: str, params: SamplingParams, samples: int, seed: int, batch: int) -> Draws:
    """``samples`` requests seeded seed, seed + 1, ...; counts their 3-token continuations.

    Up to ``batch`` requests are in flight at once; every third counted request brings a companion (greedy
    or sampled with other settings, another method, a shorter prompt) whose output is not counted.
    """
    draws = Draws(counts=np.zeros(VOCAB**NEW_TOKENS, dtype=np.int64))
    counted: dict[str, list[int]] = {}
    accept = Verifier.accept

    def spy(self, rows, trees, hidden, padded=None):
        accepted = accept(self, rows, trees, hidden, padded)
        watched = [i for i, r in enumerate(rows) if not r.params.greedy and r.request_id in counted]
        if not watched:
            return accepted
        parents, paths, lengths = (
            x[watched].tolist() for x in (trees.parents, accepted.path, accepted.lengths)
        )
        for i, row_parents, path, length in zip(watched, parents, paths, lengths, strict=True):
            if trees.sizes[i] > 1:
                first_child = {}  # in pop order a node's first child is its most probable one
                for x, p in enumerate(row_parents[: trees.sizes[i]]):
                    first_child.setdefault(p, x)
                draws.side_branch_rounds += any(first_child[row_parents[x]] != x for x in path[1:length])
        return accepted

    companions = itertools.cycle(
        [
            (SamplingParams(max_new_tokens=5), "ar"),
            (SamplingParams(temperature=0.7, top_k=3, max_new_tokens=4), "dflash"),
            (SamplingParams(max_new_tokens=6), "ddtree"),
            (SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05, max_new_tokens=7), "ddtree"),
        ]
    )
    pending = iter(range(samples))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Verifier, "accept", spy)
        while True:
            while engine.num_running + engine.num_waiting < batch:
                i = next(pending, None)
                if i is None:
                    break
                counted[engine.add_request(PROMPT, replace(params, seed=seed + i), method=method)] = []
                if i % 3 == 0:
                    companion, companion_method = next(companions)
                    engine.add_request(PROMPT[: 1 + i % len(PROMPT)], companion, method=companion_method)
            if not engine.has_unfinished_requests():
                break
            for delta in engine.step():
                if delta.request_id not in counted:
                    continue
                counted[delta.request_id] += delta.token_ids
                if delta.finish_reason is not None:
                    a, b, c = counted[delta.request_id]
                    draws.counts[(a * VOCAB + b) * VOCAB + c] += 1
                    draws.rounds += delta.stats.rounds
                    draws.multi_token_rounds += sum(n > 1 for n in delta.stats.acceptance_lengths)
                    draws.sizes.update(delta.stats.drafted_nodes)
    assert draws.counts.sum() == samples
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


def sample_and_fit(
    models,
    method: str,
    setting: str,
    samples: int,
    seed: int,
    batch: int = BATCH,
    threshold_acc: float = 1.0,
    **engine_options,
) -> tuple[Draws, float, float]:
    """Draw through the engine and test the counts against the exact law; p-values shown by -rP."""
    params = SETTINGS[setting]
    options = {"budget": BUDGET} | engine_options
    engine = Engine(*models, max_batch_size=batch, accept_threshold_acc=threshold_acc, **options)
    draws = draw(engine, method, params, samples, seed, batch)
    chi2_p, g_p = fit_p_values(draws.counts, exact_law(models[0], params))
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


def test_ddtree_samples_follow_target_distribution(real_models):
    draws, chi2_p, g_p = sample_and_fit(real_models, "ddtree", "T=1", N_FAST, seed=0)
    assert_tree_path_exercised(draws, "ddtree")
    assert chi2_p > P_PASS and g_p > P_PASS, (chi2_p, g_p)


def test_compiled_samples_follow_target_distribution(real_models):
    """Compiled rounds (``compile=True``: every round padded to one fixed shape, 32 rows x 5 nodes, dummy
    rows as the batch drains; on ``DDTREE_TEST_DEVICE=cuda`` captured in CUDA graphs) keep the law."""
    device = os.environ.get("DDTREE_TEST_DEVICE", "cpu")
    models = tuple(copy.deepcopy(m).to(device) for m in real_models)
    options = dict(compile=True, batch_buckets=[SMALL_BATCH], node_buckets=[BUDGET + 1])
    draws, chi2_p, g_p = sample_and_fit(models, "ddtree", "T=1", N_FAST, seed=0, batch=SMALL_BATCH, **options)
    assert_tree_path_exercised(draws, "ddtree")
    assert chi2_p > P_PASS and g_p > P_PASS, (chi2_p, g_p)


def test_auto_budget_samples_follow_target_distribution(real_models):
    """budget "auto" with a given cost (a fixed verify cost per node, a drafter pass worth 40% of a round):
    the chosen tree sizes vary from round to round, 0 included, and the samples keep the target's law."""
    cost = CostModel(verify=LinearCost(1.0, 0.005), draft=LinearCost(0.4, 0.0), frozen=True)
    draws, chi2_p, g_p = sample_and_fit(
        real_models, "ddtree", "T=1", N_FAST, seed=0, batch=SMALL_BATCH, budget="auto", cost_model=cost
    )
    assert draws.sizes[0] >= 0.05 * draws.rounds and len(draws.sizes) >= 3, draws.sizes
    assert chi2_p > P_PASS and g_p > P_PASS, (chi2_p, g_p)


@pytest.mark.parametrize("method", ["ddtree", pytest.param("dflash", marks=pytest.mark.slow)])
def test_biased_acceptance_fails_the_same_distribution_check(real_models, method):
    """Same check, same sample count (and seeds) as the fast test above, with the lossy acceptance
    threshold; the slow tests use more samples, which only makes a biased sampler easier to catch."""
    _, chi2_p, g_p = sample_and_fit(
        real_models, method, "T=1", N_FAST, seed=0, threshold_acc=BIASED_ACCEPTANCE
    )
    assert chi2_p < P_BROKEN and g_p < P_BROKEN, (chi2_p, g_p)


def test_a_coin_reused_across_positions_fails_the_same_distribution_check(real_models, monkeypatch):
    """The mutation of the position-keyed rule: every position of a request gets position 0's coin (the
    tokens stay in the right marginals but become dependent), and the same check at the same sample
    count rejects it."""
    real = coins.coins_at
    monkeypatch.setattr(verifier_module, "coins_at", lambda keys, positions: real(keys, positions * 0))
    _, chi2_p, g_p = sample_and_fit(real_models, "ddtree", "T=1", N_FAST, seed=0)
    assert chi2_p < P_BROKEN and g_p < P_BROKEN, (chi2_p, g_p)


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_samples_follow_target_distribution_for_every_setting(real_models, method, setting):
    draws, chi2_p, g_p = sample_and_fit(real_models, method, setting, N_SLOW, seed=1_000_000)
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


def test_an_mla_targets_samples_follow_its_distribution_with_top_p(mla_models):
    """T=1 with top-p 0.8 on an MLA target (the latent pool, absorbed verify forwards, expanded prefills):
    the engine's samples pass the chi-square and G-test against HF's warpers' exact law."""
    draws, chi2_p, g_p = sample_and_fit(mla_models, "ddtree", "top-p 0.8", N_FAST, seed=0)
    assert_tree_path_exercised(draws, "ddtree")
    assert chi2_p > P_PASS and g_p > P_PASS, (chi2_p, g_p)


def test_seeded_samples_on_an_mla_target_are_the_same_alone_or_batched(mla_models):
    """Each seeded request emits the same tokens alone and in a batch of eight with other methods."""
    params = [
        SamplingParams(temperature=t, top_p=p, seed=s, max_new_tokens=20)
        for s, (t, p) in enumerate([(1.0, 1.0), (0.7, 0.9), (1.0, 0.8), (1.3, 1.0)] * 2)
    ]
    methods = ["ddtree", "dflash", "ar", "ddtree"] * 2
    prompts = [PROMPT[: 1 + i % len(PROMPT)] for i in range(8)]
    engine = Engine(*mla_models, budget=BUDGET, max_num_seqs=8, prefill_gap_rounds=None)
    solo = [
        engine.generate(p, sp, method=m).token_ids for p, sp, m in zip(prompts, params, methods, strict=True)
    ]
    ids = [engine.add_request(p, sp, method=m) for p, sp, m in zip(prompts, params, methods, strict=True)]
    batched: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            batched[delta.request_id] += delta.token_ids
    assert [batched[i] for i in ids] == solo
    assert len({tuple(t) for t in solo}) >= 6  # the seeds and settings give different samples


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
