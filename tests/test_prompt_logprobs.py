"""Prompt scoring (vLLM's ``prompt_logprobs``): each prompt token's logprob under the target, computed in the
prefill, equal to HF's own forward over the prompt (the oracle), whatever the chunking, a prefix-cache hit
on the prompt, preemption, or the method; the output is what it is without scoring."""

from __future__ import annotations

import pytest
import torch

from ddtree import DDTreeError, Engine, SamplingParams

PROMPT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 3
)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(dtype=torch.float32, max_num_batched_tokens=48, max_num_seqs=4)


def hf_logprobs(engine: Engine, ids: list[int]) -> torch.Tensor:
    """[P - 1, V]: row k - 1 is token k's distribution, from HF's uncached forward."""
    with torch.no_grad():
        return torch.log_softmax(engine.target(input_ids=torch.tensor([ids])).logits[0, :-1].double(), dim=-1)


def assert_scores(engine: Engine, ids: list[int], scored, top: int) -> None:
    ref = hf_logprobs(engine, ids)
    assert len(scored) == len(ids) and scored[0] is None
    for k in range(1, len(ids)):
        entry = scored[k]
        assert entry.token == ids[k]
        assert abs(entry.logprob - float(ref[k - 1, ids[k]])) < 1e-4
        assert [t for t, _ in entry.top] == ref[k - 1].topk(top).indices.tolist()


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_prompt_logprobs_equal_hfs_forward_across_prefill_chunks(engine, method):
    ids = engine.encode(PROMPT)
    assert len(ids) > 2 * 48  # three chunks at least
    plain = engine.generate(PROMPT, SamplingParams(max_new_tokens=8), method=method)
    scored = engine.generate(PROMPT, SamplingParams(max_new_tokens=8, prompt_logprobs=3), method=method)
    assert_scores(engine, ids, scored.prompt_logprobs, 3)
    assert scored.token_ids == plain.token_ids and plain.prompt_logprobs is None


def test_a_cached_prompt_is_scored_whole_and_its_blocks_stay_shared(engine):
    ids = engine.encode(PROMPT)
    engine.generate(PROMPT, SamplingParams(max_new_tokens=4))  # the prompt's blocks are now cached
    scored = engine.generate(PROMPT, SamplingParams(max_new_tokens=4, prompt_logprobs=0))
    assert scored.stats.cached_tokens == 0  # every prompt token computed, so scored
    assert_scores(engine, ids, scored.prompt_logprobs, 0)
    assert engine.generate(PROMPT, SamplingParams(max_new_tokens=4)).stats.cached_tokens > 0


def test_preempted_scoring_requests_score_each_prompt_token_once(engine):
    small = Engine(
        engine.target, engine.runner.drafter, engine.tokenizer, max_num_seqs=4, max_model_len=256,
        max_num_batched_tokens=48, kv_cache_memory=18 * 16 * engine.runner.kv_cache_bytes_per_token * 2,
    )  # fmt: skip
    prompts = [PROMPT[i:] for i in range(4)]
    # ~125 prompt tokens, 100 new and a 17-node tree: a request ends in 15-16 of the pool's 18 blocks, so two
    # never both finish without a preemption, whatever the timing (with 20 blocks, 60 new tokens and budget
    # "auto", whose trees follow timing and the drafter, a loaded CI box ran them without one)
    params = SamplingParams(max_new_tokens=100, prompt_logprobs=1)
    results = small.generate(prompts, params, method="ddtree", budget=16)
    assert small.num_preemptions > 0
    for prompt, result in zip(prompts, results, strict=True):
        assert_scores(engine, engine.encode(prompt), result.prompt_logprobs, 1)


def test_a_prompt_logprobs_count_out_of_bounds_is_a_one_line_error():
    with pytest.raises(DDTreeError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
