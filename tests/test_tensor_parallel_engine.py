"""The engine under tensor parallelism: two gloo ranks on the CPU (``Engine.from_pretrained`` spawns rank 1).

Rank 0 runs the scheduler, the drafter, the trees, the LM head and every coin; rank 1 holds half of the
target's heads, MLP and KV pool and runs the same target forwards. So greedy ``ddtree`` and ``dflash``
must emit ``ar``'s tokens and one process's tokens; seeded samples must not depend on the batch; and the
samples must follow the target's distribution (a G-test against the enumerated law, as
``test_sampling_lossless`` does in one process).
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from ddtree.drafter import DFlashDrafter, dflash_config
from ddtree.engine import Engine
from ddtree.engine.ranks import TensorParallelError
from ddtree.errors import DDTreeError
from ddtree.params import SamplingParams
from tests import test_sampling_lossless as lossless

TP = 2
OPTIONS = dict(dtype=torch.float32, max_model_len=512, kv_cache_memory="64MiB", max_num_seqs=8)
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


def tokens(engine: Engine, method: str, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(PROMPTS, params, method=method)]


def test_greedy_under_tensor_parallelism_equals_ar_and_one_process(single, sharded):
    assert sharded.tensor_parallel_size == TP and sharded.runner.forward.num_heads == 2  # of 4
    greedy = SamplingParams(max_new_tokens=NEW)
    reference = tokens(single, "ar", greedy)
    for method in ("ar", "dflash", "ddtree"):
        assert tokens(sharded, method, greedy) == reference, method
    stats = sharded.runner.channel.stats
    assert stats.calls > 0 and stats.bytes > 0  # every step went through the channel


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


def test_fixed_shapes_under_tensor_parallelism_emit_the_same_tokens(single):
    """Padded batches and trees (dummy rows and nodes) on both ranks: the same greedy tokens."""
    greedy = SamplingParams(max_new_tokens=NEW)
    options = OPTIONS | dict(fixed_shapes=True, batch_buckets=[2, 8], node_buckets=[17])
    with Engine.from_pretrained(tensor_parallel_size=TP, **options) as padded:
        assert tokens(padded, "ddtree", greedy) == tokens(single, "ar", greedy)


def save_tp_pair(directory) -> Qwen3ForCausalLM:
    """``test_sampling_lossless``'s tiny pair with two KV heads (one per rank), saved for the ranks."""
    config = Qwen3Config(
        vocab_size=lossless.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        initializer_range=lossless.TARGET_INIT,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(lossless.TARGET_SEED)
        target = Qwen3ForCausalLM(config).eval()
        torch.manual_seed(lossless.DRAFTER_SEED)
        drafter_config = dflash_config(
            config,
            num_layers=1,
            block_size=4,
            mask_token_id=lossless.VOCAB - 1,
            initializer_range=lossless.DRAFTER_INIT,
        )
        drafter = DFlashDrafter(drafter_config).eval()
    target.save_pretrained(directory / "target")
    drafter.save_pretrained(directory / "drafter")
    return target


def test_samples_under_tensor_parallelism_follow_the_target_distribution(tmp_path):
    target = save_tp_pair(tmp_path)
    params = lossless.SETTINGS["T=1"]
    with Engine.from_pretrained(
        tmp_path / "target",
        tmp_path / "drafter",
        tensor_parallel_size=TP,
        dtype=torch.float32,
        budget=lossless.BUDGET,
        max_num_seqs=lossless.BATCH,
    ) as engine:
        draws = lossless.draw(engine, "ddtree", params, lossless.N_FAST, seed=7_000)
    chi2_p, g_p = lossless.fit_p_values(draws.counts, lossless.exact_law(target, params))
    print(f"TP {TP} ddtree T=1 n={lossless.N_FAST}: chi-square p={chi2_p:.3g} G-test p={g_p:.3g}")
    lossless.assert_tree_path_exercised(draws, "ddtree")
    assert g_p > lossless.P_PASS and chi2_p > lossless.P_PASS


def test_a_rank_that_dies_fails_the_next_step_in_one_line(tmp_path):
    save_tp_pair(tmp_path)
    engine = Engine.from_pretrained(
        tmp_path / "target", tmp_path / "drafter", tensor_parallel_size=TP, dtype=torch.float32
    )
    reasons = []
    engine.watch_ranks(reasons.append)
    engine.runner.channel.ranks.processes[0].kill()
    deadline = time.monotonic() + 10
    while not reasons and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reasons == ["tensor-parallel rank 1 exited (exit code -9)"]
    with pytest.raises(TensorParallelError, match="rank 1 exited") as info:
        engine.generate([1, 2, 3], replace(SamplingParams(), max_new_tokens=2))
    assert "\n" not in str(info.value)
    ranks = engine.runner.channel.ranks
    engine.close()  # the other ranks are killed, not told: one of them can no longer answer
    assert not any(p.is_alive() for p in ranks.processes)


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (0, "tensor_parallel_size must be an integer >= 1"),
        (3, r"num_attention_heads \(4\) and num_key_value_heads \(2\) divisible by 3"),
    ],
)
def test_a_size_that_cannot_shard_the_target_is_refused_in_one_line(size, message):
    with pytest.raises(DDTreeError, match=message) as info:
        Engine.from_pretrained(tensor_parallel_size=size, **OPTIONS)
    assert "\n" not in str(info.value)
