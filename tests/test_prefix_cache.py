"""Prefix caching: a request whose prompt starts with full blocks an earlier request computed maps them into
its table and prefills only the rest, for the target and the drafter alike. Nothing about its output may
change: the same tokens (greedy), the same samples (seeded), the same acceptance length every round (the
drafter's context is whole after a hit). The pool's accounting stays exact through hits, aborts,
preemptions and evictions, and different ``cache_salt``s never share a block."""

from __future__ import annotations

import random

import pytest
import torch

from ddtree import Engine, SamplingParams
from tests.conftest import VOCAB, moe_drafter, tiny_drafter, tiny_moe_target, tiny_target

BLOCK = 16
SHARED = 100  # a shared prefix that ends inside a block (6 full blocks and 4 tokens)


def tokens(n: int, salt: int = 0) -> list[int]:
    return [2 + (salt + 5 * j + j * j * salt) % (VOCAB - 3) for j in range(n)]


PREFIX = tokens(SHARED)
PROMPTS = [PREFIX + tokens(5 + i, salt=i + 1) for i in range(3)]
GREEDY = SamplingParams(max_new_tokens=40)


@pytest.fixture(scope="module")
def models():
    target = tiny_target()
    target.config.max_position_embeddings = 4096
    return target, tiny_drafter(target)


def engine(models, caching: bool = True, **options) -> Engine:
    # A fixed budget (seeded samples repeat only with a fixed tree) and scheduling that does not depend on
    # timing, so the only difference between two engines is the cache.
    fixed = {"max_model_len": 512, "budget": 16, "prefill_gap_rounds": None, "block_size": BLOCK}
    return Engine(*models, enable_prefix_caching=caching, **(fixed | options))


def outputs(e: Engine, params: list[SamplingParams], method: str) -> list[tuple[list[int], list[int], int]]:
    """The first prompt alone (it fills the cache), then the others batched (they hit, or not): each
    result's tokens, acceptance lengths and cached prompt tokens."""
    first = e.generate(PROMPTS[0], params[0], method=method)
    rest = e.generate(PROMPTS[1:], params[1:], method=method)
    return [(r.token_ids, r.stats.acceptance_lengths, r.stats.cached_tokens) for r in [first, *rest]]


def assert_accounting(e: Engine) -> None:
    """The block manager's accounting holds for the running requests' tables, and an idle engine has
    every allocatable block back."""
    e.blocks.check_invariants(r.blocks for r in e.scheduler.running)
    if not e.scheduler.has_unfinished():
        assert e.blocks.num_free == e.blocks.num_blocks - 1


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_hit_changes_no_token_and_no_acceptance_length(models, method, sampled):
    params = [
        SamplingParams(max_new_tokens=40, temperature=0.9, top_p=0.95, seed=7 + i) if sampled else GREEDY
        for i in range(len(PROMPTS))
    ]
    cold = outputs(engine(models, caching=False), params, method)
    e = engine(models)
    warm = outputs(e, params, method)
    assert [(t, a) for t, a, _ in warm] == [(t, a) for t, a, _ in cold]
    full = SHARED // BLOCK * BLOCK  # the prefix's full blocks: the partial last one stays private
    assert [c for _, _, c in warm] == [0, full, full] and all(c == 0 for _, _, c in cold)
    assert e.blocks.hit_tokens == 2 * full and e.blocks.queried_tokens == sum(map(len, PROMPTS))
    assert_accounting(e)


def test_a_request_hits_what_its_finished_owner_generated(models):
    """A follow-up turn's prompt holds the earlier answer: the blocks of generated tokens are cached too,
    and the drafter resumes from them as a cold run's would."""
    e, cold = engine(models), engine(models, caching=False)
    first = e.generate(PROMPTS[0], GREEDY, method="ddtree")
    follow_up = PROMPTS[0] + first.token_ids + tokens(3, salt=9)
    warm = e.generate(follow_up, GREEDY, method="ddtree")
    reference = cold.generate(follow_up, GREEDY, method="ddtree")
    assert warm.token_ids == reference.token_ids
    assert warm.stats.acceptance_lengths == reference.stats.acceptance_lengths
    assert warm.stats.cached_tokens >= (len(PROMPTS[0]) + len(first.token_ids) - BLOCK) // BLOCK * BLOCK
    assert_accounting(e)


def test_a_whole_prompt_in_the_cache_still_computes_its_last_token(models):
    """A prompt of exactly four blocks, sent twice: the second time three blocks hit and the last block is
    prefilled again (its last token's logits give the first output token)."""
    e = engine(models)
    prompt = tokens(4 * BLOCK, salt=3)
    cold = e.generate(prompt, GREEDY, method="dflash")
    warm = e.generate(prompt, GREEDY, method="dflash")
    assert warm.token_ids == cold.token_ids and warm.stats.cached_tokens == 3 * BLOCK
    assert_accounting(e)


def test_preempted_requests_resume_from_their_cached_blocks(models):
    """A pool too small for every request preempts; a preempted request's blocks stay cached until the
    pool needs them, so its recompute hits. Outputs are those of a pool that never preempts."""
    params = [SamplingParams(max_new_tokens=60, temperature=0.8, seed=i) for i in range(4)]
    prompts = [PREFIX + tokens(9, salt=i + 5) for i in range(4)]
    reference = engine(models, caching=False).generate(prompts, params, method="ddtree")
    e = engine(models, max_model_len=192, kv_cache_memory=22 * BLOCK * e_bytes_per_token(models))
    results = e.generate(prompts, params, method="ddtree")
    assert e.num_preemptions > 0 and e.blocks.hit_tokens > 0
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert_accounting(e)


def e_bytes_per_token(models) -> int:
    """Bytes one token costs in both pools of ``engine(models)`` (to size a pool in blocks)."""
    probe = engine(models, max_model_len=192, kv_cache_memory="1MiB")
    return probe.runner.kv_cache_bytes // ((probe.blocks.num_blocks) * BLOCK)


def test_different_cache_salts_never_share_a_block(models):
    e = engine(models)
    cached = []
    for salt in ("tenant-a", "tenant-b", None, "tenant-a", None):
        request_id = e.add_request(PROMPTS[0], GREEDY, method="ddtree", cache_salt=salt)
        while e.has_unfinished_requests():
            for delta in e.step():
                if delta.request_id == request_id and delta.finish_reason is not None:
                    cached.append(delta.stats.cached_tokens)
    full = SHARED // BLOCK * BLOCK
    assert cached == [0, 0, 0, full, full]  # only a salt seen before (or none, twice) hits
    assert_accounting(e)


def test_the_pool_accounts_for_every_block_through_random_schedules(models):
    """Random arrivals (shared and private prefixes), aborts and a pool small enough to preempt and evict:
    after every step each block is free, cached or owned exactly as often as tables hold it; at the end
    the whole pool is available again and the cache still answers."""
    for seed in range(3):
        rng = random.Random(seed)
        small = {"max_model_len": 192, "max_num_seqs": 4}
        e = engine(models, kv_cache_memory=20 * BLOCK * e_bytes_per_token(models), **small)
        live: list[str] = []
        for _ in range(60):
            if rng.random() < 0.3:
                prefix = PREFIX[: rng.choice([0, 20, 48, SHARED])]
                prompt = prefix + tokens(rng.randint(1, 30), salt=rng.randint(1, 50))
                method = rng.choice(["ar", "dflash", "ddtree"])
                params = SamplingParams(max_new_tokens=rng.randint(1, 40))
                live.append(e.add_request(prompt, params, method=method))
            if live and rng.random() < 0.08:
                e.abort(live.pop(rng.randrange(len(live))))
            if e.has_unfinished_requests():
                for delta in e.step():
                    if delta.finish_reason is not None and delta.request_id in live:
                        live.remove(delta.request_id)
            assert_accounting(e)
        while e.has_unfinished_requests():
            e.step()
        assert_accounting(e)
        assert e.blocks.num_indexed > 0 and e.blocks.hit_tokens > 0


def test_the_invariant_check_catches_a_table_that_lost_a_block(models):
    """The accounting check is no formality: a running request's table missing one block (as a leak
    would leave it) fails it."""
    e = engine(models)
    e.add_request(PROMPTS[0], SamplingParams(max_new_tokens=8), method="ar")
    e.step()
    tables = [list(r.blocks) for r in e.scheduler.running]
    e.blocks.check_invariants(tables)
    tables[0].pop()
    with pytest.raises(AssertionError, match="reference counts"):
        e.blocks.check_invariants(tables)


def test_an_mla_target_caches_its_latent_blocks(models):
    """DeepSeek-V3's latent pool is shared through the same tables: a hit is exact there too."""
    target = tiny_moe_target("deepseek_v3")
    target.config.max_position_embeddings = 1024
    drafter = moe_drafter(target)
    params = [GREEDY] * len(PROMPTS)
    kw = dict(max_model_len=256, budget=8, prefill_gap_rounds=None)
    with torch.no_grad():
        cold = outputs(Engine(target, drafter, enable_prefix_caching=False, **kw), params, "ddtree")
        warm = outputs(Engine(target, drafter, **kw), params, "ddtree")
    assert [(t, a) for t, a, _ in warm] == [(t, a) for t, a, _ in cold]
    assert warm[1][2] == SHARED // BLOCK * BLOCK


def test_without_prefix_caching_nothing_is_indexed(models):
    e = engine(models, caching=False)
    outputs(e, [GREEDY] * 3, "ddtree")
    assert e.blocks.num_indexed == 0 and e.blocks.queried_tokens == 0 and e.blocks.hit_tokens == 0
    assert_accounting(e)


def test_the_built_in_pair_drafts_after_a_hit_exactly_as_cold():
    """With a trained drafter (tau about 4 here) a drafter context lost or shifted by a hit would show in
    the acceptance lengths: they match a cold run's round by round, and so do the tokens."""
    warm = Engine.from_pretrained(budget=16, prefill_gap_rounds=None, max_model_len=1024)
    cold = Engine(warm.target, warm.runner.drafter, warm.tokenizer, budget=16, prefill_gap_rounds=None,
                  max_model_len=1024, enable_prefix_caching=False)  # fmt: skip
    system = "You are a careful Python programmer. Write small, clear functions with docstrings. " * 4
    prompts = [system + q for q in ("def fibonacci(n):", "def is_prime(n):", "def quicksort(xs):")]
    params = SamplingParams(max_new_tokens=48)
    results = {}
    for name, e in (("warm", warm), ("cold", cold)):
        results[name] = [e.generate(prompts[0], params), *e.generate(prompts[1:], params)]
    ids = [warm.encode(p) for p in prompts]
    shared = next(i for i, column in enumerate(zip(*ids, strict=False)) if len(set(column)) > 1)
    assert shared >= 64 and [r.stats.cached_tokens for r in results["warm"]] == [0, *[shared // 16 * 16] * 2]
    assert all(r.stats.tau > 2 for r in results["warm"])
    for w, c in zip(results["warm"], results["cold"], strict=True):
        assert w.token_ids == c.token_ids
        assert w.stats.acceptance_lengths == c.stats.acceptance_lengths


def test_reset_prefix_cache_makes_the_next_request_cold(models):
    """vLLM's ``reset_prefix_cache``: what benchmarks call between configurations on the same prompts."""
    e = engine(models)
    e.generate(PROMPTS[0], GREEDY, method="ar")
    assert e.blocks.num_indexed > 0
    e.reset_prefix_cache()
    assert e.blocks.num_indexed == 0 and e.generate(PROMPTS[0], GREEDY, method="ar").stats.cached_tokens == 0
    assert_accounting(e)
