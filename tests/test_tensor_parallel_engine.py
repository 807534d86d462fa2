"""The engine under tensor parallelism: two gloo ranks on the CPU (``Engine.from_pretrained`` spawns rank 1).

Rank 0 runs the scheduler, the drafter, the trees, the LM head and every coin; rank 1 holds half of the
target's heads, MLP and KV pool and runs the same target forwards. So greedy ``ddtree`` and ``dflash``
must emit ``ar``'s tokens and one process's tokens; seeded samples must not depend on the batch; and the
samples must follow the target's distribution (``test_tensor_parallel_lossless``; MoE and MLA targets:
``test_tensor_parallel_moe``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ddtree.engine import Engine
from ddtree.request.params import SamplingParams
from tests.test_seeded_equality import assert_same_or_ties

TP = 2
# budget 16: a seed repeats a sample only with a fixed tree (under auto the tree follows timing)
OPTIONS = dict(dtype=torch.float32, max_model_len=512, kv_cache_memory="64MiB", max_num_seqs=8, budget=16)
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\n\n",
    "Once upon a time",
    "for i in range(10):",
]
NEW = 40


@pytest.fixture(scope="module")
def single() -> Engine:
    return Engine.from_pretrained(**OPTIONS)


@pytest.fixture(scope="module")
def sharded():
    with Engine.from_pretrained(tensor_parallel_size=TP, **OPTIONS) as engine:
        yield engine


def tokens(
    engine: Engine,
    method: str,
    params: SamplingParams | list[SamplingParams],
    prompts: list[str] = PROMPTS,
) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(prompts, params, method=method)]


def test_greedy_under_tensor_parallelism_equals_ar_and_one_process(single, sharded):
    assert sharded.tensor_parallel_size == TP and sharded.runner.forward.num_heads == 2  # of 4
    greedy = SamplingParams(max_new_tokens=NEW)
    reference = tokens(single, "ar", greedy)
    for method in ("ar", "dflash", "ddtree"):
        assert tokens(sharded, method, greedy) == reference, method
    stats = sharded.runner.channel.stats
    assert stats.calls > 0 and stats.bytes > 0  # every step went through the channel


def test_penalties_under_tensor_parallelism_equal_one_process(single, sharded):
    """Rank 0 penalises every node (its LM head's logits): the same tokens as one process."""
    params = SamplingParams(
        max_new_tokens=NEW, frequency_penalty=0.6, repetition_penalty=1.3, min_tokens=8, bad_words=("def",)
    )
    reference = tokens(single, "ar", params)
    assert reference != tokens(single, "ar", SamplingParams(max_new_tokens=NEW))
    for method in ("ar", "ddtree"):
        assert tokens(sharded, method, params) == reference, method


def test_seeded_samples_under_tensor_parallelism_do_not_depend_on_the_batch(sharded):
    specs = [
        (PROMPTS[0], SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_new_tokens=NEW), "ddtree"),
        (PROMPTS[1], SamplingParams(temperature=1.0, seed=2, max_new_tokens=NEW), "dflash"),
        (PROMPTS[2], SamplingParams(temperature=0.7, top_k=20, seed=3, max_new_tokens=NEW), "ar"),
    ]
    solo = [sharded.generate(p, sp, method=m).token_ids for p, sp, m in specs]
    ids = [sharded.add_request(p, sp, method=m) for p, sp, m in specs]
    sharded.add_request(PROMPTS[3], SamplingParams(max_new_tokens=NEW // 2), method="ddtree", budget=64)
    sharded.add_request(PROMPTS[4], SamplingParams(temperature=1.0, max_new_tokens=NEW), method="dflash")
    batched = {i: [] for i in ids}
    while sharded.has_unfinished_requests():
        for delta in sharded.step():
            if delta.request_id in batched:
                batched[delta.request_id] += delta.token_ids
    assert [batched[i] for i in ids] == solo
    assert all(len(t) == NEW for t in solo)


def test_seeded_samples_under_tensor_parallelism_are_one_processes_plain_samples(single, sharded):
    """A seed is an answer across the shard count too (float32): seeded ``ar``, ``dflash`` and ``ddtree``
    on two ranks emit one process's seeded ``ar`` tokens. The all-reduce sums the ranks' partial sums in
    another order than one process's matmul, so a position may differ only where the coin sits within
    ``TIE`` of a CDF boundary of the target's law there (reported with its distance)."""
    settings = [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20, min_p=0.05),
    ]
    for i, setting in enumerate(settings):
        params = [replace(setting, seed=100 * i + j, max_new_tokens=NEW, ignore_eos=True) for j in range(3)]
        prompts = PROMPTS[:3]
        reference = tokens(single, "ar", params, prompts)
        assert len(set(map(tuple, reference))) == len(prompts)
        for method in ("ar", "dflash", "ddtree"):
            for prompt, sp, want, got in zip(
                prompts, params, reference, tokens(sharded, method, params, prompts), strict=True
            ):
                assert_same_or_ties(single, prompt, sp, want, got)


def test_prefix_cache_hits_under_tensor_parallelism_equal_a_cold_process(single, sharded):
    """Rank 0's block tables map cached blocks into every rank's pool shard alike: a hit is exact there."""
    system = "You are a careful Python programmer. Write small, clear functions with docstrings. " * 3
    prompts = [system + q for q in ("def fibonacci(n):", "def is_prime(n):", "def quicksort(xs):")]
    options = {k: v for k, v in OPTIONS.items() if k != "dtype"}
    cold = Engine(
        single.target, single.runner.drafter, single.tokenizer, enable_prefix_caching=False, **options
    )
    greedy = SamplingParams(max_new_tokens=NEW)
    hits = sharded.blocks.hit_tokens
    warm = [sharded.generate(prompts[0], greedy), *sharded.generate(prompts[1:], greedy)]
    assert all(r.stats.cached_tokens >= 64 for r in warm[1:]) and sharded.blocks.hit_tokens > hits
    reference = [cold.generate(p, greedy) for p in prompts]
    assert [r.token_ids for r in warm] == [r.token_ids for r in reference]
    assert [r.stats.acceptance_lengths for r in warm] == [r.stats.acceptance_lengths for r in reference]
