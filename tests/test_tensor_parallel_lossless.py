"""Tensor parallelism, each test with engines of its own (one process group per process at a time): fixed
shapes, the G-test of sampled outputs against the target's enumerated law (as ``test_sampling_lossless``
does in one process), a rank that dies, and sizes that cannot shard the target."""

from __future__ import annotations

import time

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ddtree.engine import Engine
from ddtree.engine.step_channel import TensorParallelError
from ddtree.errors import DDTreeError
from ddtree.request.params import SamplingParams
from tests import test_sampling_lossless as lossless
from tests.conftest import real_size_models
from tests.oracles import assert_bf16_tie
from tests.test_tensor_parallel_engine import NEW, OPTIONS, TP, tokens


def test_fixed_shapes_under_tensor_parallelism_emit_the_same_tokens():
    """Padded batches and trees (dummy rows and nodes) on both ranks: the same greedy tokens."""
    greedy = SamplingParams(max_new_tokens=NEW)
    options = OPTIONS | dict(fixed_shapes=True, batch_buckets=[2, 8], node_buckets=[17])
    with Engine.from_pretrained(tensor_parallel_size=TP, **options) as padded:
        got = tokens(padded, "ddtree", greedy)
    assert got == tokens(Engine.from_pretrained(**OPTIONS), "ar", greedy)


def test_compiled_engine_under_tensor_parallelism_emits_the_same_tokens_without_recompiling():
    """``compile=True`` on both ranks (rank 0: the verify and draft graphs; rank 1: the verify graph, with
    the all-reduces inside it): after the warm-up no round compiles, and the tokens are one process's."""
    greedy = SamplingParams(max_new_tokens=NEW)
    options = OPTIONS | dict(max_num_seqs=4, compile=True, batch_buckets=[4], node_buckets=[17])
    with Engine.from_pretrained(tensor_parallel_size=TP, **options) as compiled:
        graphs = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = {m: tokens(compiled, m, greedy) for m in ("dflash", "ddtree")}
        assert counters["stats"]["unique_graphs"] == graphs
        assert sum(counters["graph_break"].values()) == 0
    reference = tokens(Engine.from_pretrained(**OPTIONS), "ar", greedy)
    assert got == {"dflash": reference, "ddtree": reference}


def save_tp_pair(directory) -> Qwen3ForCausalLM:
    """``test_sampling_lossless``'s tiny pair, its target with its one KV head stored twice (one per rank:
    query head i reads KV head i, the same weights, so the law and the drafts are unchanged), saved."""
    target, drafter = lossless.build_models()
    config = Qwen3Config(**(target.config.to_dict() | {"num_key_value_heads": 2}))
    doubled = Qwen3ForCausalLM(config).eval()
    state = target.state_dict()
    for name in state:
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            state[name] = state[name].repeat(2, 1)  # [D, H] -> [2 D, H]: the head, then its copy
    doubled.load_state_dict(state)
    doubled.save_pretrained(directory / "target")
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
        draws = lossless.draw(engine, "ddtree", params, lossless.N_FAST, seed=7_000, batch=lossless.BATCH)
    chi2_p, g_p = lossless.fit_p_values(draws.counts, lossless.exact_law(target, params))
    print(f"TP {TP} ddtree T=1 n={lossless.N_FAST}: chi-square p={chi2_p:.3g} G-test p={g_p:.3g}")
    lossless.assert_tree_path_exercised(draws, "ddtree")
    assert g_p > lossless.P_PASS and chi2_p > lossless.P_PASS


def kill_rank_1_and_expect_one_line(engine: Engine, prompt) -> None:
    """Kill rank 1: the watcher names it within 10 s and the next step fails in one line naming it."""
    reasons = []
    engine.watch_ranks(reasons.append)
    engine.runner.channel.ranks.processes[0].kill()
    deadline = time.monotonic() + 10
    while not reasons and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reasons == ["tensor-parallel rank 1 exited (exit code -9)"]
    with pytest.raises(TensorParallelError, match="rank 1 exited") as info:
        engine.generate(prompt, SamplingParams(max_new_tokens=2))
    assert "\n" not in str(info.value)


def test_a_rank_that_dies_fails_the_next_step_in_one_line(tmp_path):
    save_tp_pair(tmp_path)
    engine = Engine.from_pretrained(
        tmp_path / "target", tmp_path / "drafter", tensor_parallel_size=TP, dtype=torch.float32
    )
    kill_rank_1_and_expect_one_line(engine, [1, 2, 3])
    engine.close()  # the other ranks are killed, not told: one of them can no longer answer
    assert not any(p.is_alive() for p in engine.runner.channel.ranks.processes)
    with pytest.raises(TensorParallelError, match="was closed"):  # never rank 0's shard alone
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))


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


def test_an_engine_built_from_models_in_memory_cannot_shard_them():
    single = Engine.from_pretrained(**OPTIONS)
    with pytest.raises(DDTreeError, match=r"needs Engine.from_pretrained\(TARGET_DIR") as info:
        Engine(single.target, single.runner.drafter, single.tokenizer, tensor_parallel_size=2)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_real_shapes_under_tensor_parallelism_are_lossless_and_differ_from_one_process_only_at_ties(tmp_path):
    """Qwen3-0.6B's shapes (vocabulary 151936, GQA 16/8, head_dim 128, a 40,960-token context), 2 layers,
    bf16: within TP 2, ddtree emits ar's tokens. Against one process, the all-reduce sums bf16 partial sums
    in another order; with random weights the logits are near-flat, so a greedy pick may flip, and only at
    a tie: at the first difference of a prompt both picks are within two bf16 steps of the top logit
    (printed with the gap; measured: one step, 0.0156 at logits near 2.8)."""
    target_dir, drafter_dir = real_size_models(tmp_path, layers=2)
    prompts = [[5 + i, 17, 151935, 9000 + i, 77, 12] for i in range(4)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    options = dict(kv_cache_memory="1GiB", max_num_seqs=4)
    one = [
        r.token_ids
        for r in Engine.from_pretrained(target_dir, drafter_dir, **options).generate(
            prompts, params, method="ar"
        )
    ]
    with Engine.from_pretrained(target_dir, drafter_dir, tensor_parallel_size=TP, **options) as sharded:
        assert sharded.max_model_len == 40960
        ar = [r.token_ids for r in sharded.generate(prompts, params, method="ar")]
        # a fixed budget: under "auto" the trees follow the machine's timing, and bf16 logits of other tree
        # shapes may round a near-tie the other way (issue 44's open bf16 invariance)
        assert [r.token_ids for r in sharded.generate(prompts, params, method="ddtree", budget=16)] == ar
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    for prompt, mine, theirs in zip(prompts, one, ar, strict=True):
        if mine == theirs:
            continue
        k = next(j for j, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + mine[:k]])).logits[0, -1].float()  # [V]
        gap = (logits[mine[k]] - logits[theirs[k]]).item()
        print(f"token {k}: one process {mine[k]}, TP {TP} {theirs[k]}, logit gap {gap:.4f}")
        # each of the forward's 4 all-reduces rounds its sum once: a pick within 2 steps of the top is a tie
        assert_bf16_tie(logits, [mine[k], theirs[k]])
