"""MoE and MLA targets under tensor parallelism, through the engine: two gloo ranks on the CPU.

Each rank holds half the routed experts (the router whole), half the shared experts and dense MLPs, half
the heads, and for MLA the whole latent pool; greedy ``ar`` and ``ddtree`` emit one process's tokens, and
seeded samples are one process's: for Qwen3-MoE and GLM-4 MoE in float32, DeepSeek-V3 from an FP8 block-scaled
checkpoint and Kimi K2.5 from one with INT4 routed experts (each rank dequantizing its own slices). (Its
own module: one tensor-parallel engine per process at a time, and ``test_tensor_parallel_engine`` holds
one for the whole of its module.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.request.params import SamplingParams
from tests.conftest import deepseek_v3_fields, moe_drafter, tiny_moe_target, tiny_tokenizer
from tests.test_loading import save_quantized
from tests.test_tensor_parallel_engine import PROMPTS, TP, tokens
from tests.test_tensor_parallel_lossless import kill_rank_1_and_expect_one_line

OPTIONS = dict(dtype=torch.float32, max_model_len=128, kv_cache_memory="8MiB", max_num_seqs=4, budget=8)
NEW = 16


# Each ended after its test: one TP engine per process at a time.
@pytest.fixture(params=["deepseek_v3", "qwen3_moe", "glm4_moe", "kimi_k25"])
def engines(request, tmp_path_factory):
    """(kind, one process's engine, a TP-2 engine) over a saved tiny MoE target, 8 routed experts, top-2,
    a dense layer 0: DeepSeek-V3 (MLA, shared experts) as its FP8 block-scaled checkpoint, Qwen3-MoE and
    GLM-4 MoE (GQA; GLM's shared experts) in float32, Kimi K2.5's wrapper with its routed experts INT4
    pack-quantized. A quantized checkpoint loads slice-wise in one process too; each rank dequantizes only
    its slices."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    tokenizer = tiny_tokenizer()
    target = tiny_moe_target(kind, vocab=len(tokenizer), image_token_id=len(tokenizer))
    if kind in ("qwen3_moe", "glm4_moe"):
        target.save_pretrained(root / "target")
    else:
        save_quantized(target, kind, root / "target")
    tokenizer.save_pretrained(root / "target")
    moe_drafter(target).save_pretrained(root / "drafter")
    dirs = (root / "target", root / "drafter")
    single = Engine.from_pretrained(*dirs, **OPTIONS)
    with Engine.from_pretrained(*dirs, tensor_parallel_size=TP, **OPTIONS) as sharded:
        yield kind, single, sharded


def test_a_moe_target_under_tensor_parallelism_equals_one_process(engines):
    kind, single, sharded = engines
    experts = sharded.runner.target.get_decoder().layers[1].mlp.experts
    assert experts.num_experts == 4 and experts.down_proj.shape[0] == 4  # rank 0's: experts 0..3 of 8
    assert sharded.runner.forward.num_heads == 2  # of 4
    if kind not in ("qwen3_moe", "glm4_moe"):  # MLA's latent pool: every rank's is one process's
        assert sharded.runner.cache.layout.is_latent
        assert sharded.runner.cache.nbytes() == single.runner.cache.nbytes()
    prompts = PROMPTS[:3]
    greedy = SamplingParams(max_new_tokens=NEW)
    reference = tokens(single, "ar", greedy, prompts)
    assert all(len(set(r)) > 3 for r in reference)  # not one repeated token
    for method in ("ar", "ddtree"):
        assert tokens(sharded, method, greedy, prompts) == reference, method
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_new_tokens=NEW) for s in (1, 2, 3)]
    for method in ("ar", "ddtree"):
        assert tokens(sharded, method, seeded, prompts) == tokens(single, method, seeded, prompts), method


def test_experts_that_do_not_split_over_the_ranks_are_refused_in_one_line(tmp_path):
    """5 routed experts over 2 ranks: every rank refuses before it changes a weight; nothing hangs."""
    tokenizer = tiny_tokenizer()
    fields = deepseek_v3_fields(vocab=len(tokenizer), layers=2) | dict(n_routed_experts=5, n_group=1)
    DeepseekV3ForCausalLM(DeepseekV3Config(**fields)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(DDTreeError, match=r"routed experts \(5\) divisible by 2") as info:
        Engine.from_pretrained(tmp_path, method="ar", tensor_parallel_size=TP, **OPTIONS)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("engines", ["deepseek_v3"], indirect=True)
def test_a_rank_of_a_moe_engine_that_dies_fails_the_next_step_in_one_line(engines):
    """As for dense targets: rank 1 killed mid-run is named in one line, nothing waits on a collective."""
    _, _, sharded = engines
    kill_rank_1_and_expect_one_line(sharded, PROMPTS[0])
