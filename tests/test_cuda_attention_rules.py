"""Attention's CUDA choices, checked on the CPU against torch's own rules (no GPU needed).

Flex: ``flex_kernel_options`` must give every real head shape, at every tree size up to a 256-node budget,
the drafter's block and the prefill chunks, a Triton config that torch 2.13's CUDA lowering accepts.
``lowered`` restates that lowering's gates, each next to the torch source line that states it; torch's
own config tables (``CUDAConfigHeuristic``, at each GPU generation's capability) give the defaults.
SDPA: with a mask on CUDA the KV heads are expanded (never ``enable_gqa`` with a mask, which only the math
kernel runs), and the expanded call returns exactly what the GQA call does.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.kernel.flex import flex_attention as torch_flex
from torch._inductor.kernel.flex import flex_decoding as torch_decode
from torch._inductor.runtime.runtime_utils import is_power_of_2, next_power_of_2
from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic

from ddtree.errors import DDTreeError
from ddtree.model.attention import FLEX_Q_BLOCK, flex_kernel_options, sdpa_operands
from ddtree.model.capture import node_ladder

# (name, query heads, KV heads, q/k head dim, v head dim) as one rank's attention sees them
REAL = [
    ("Qwen3-0.6B", 16, 8, 128, 128),
    ("Qwen3-1.7B", 16, 8, 128, 128),
    ("Qwen3-4B", 32, 8, 128, 128),
    ("Qwen3-8B", 32, 8, 128, 128),
    ("Qwen3-14B", 40, 8, 128, 128),  # GQA 5
    ("Qwen3-32B", 64, 8, 128, 128),
    ("Qwen2.5-7B", 28, 4, 128, 128),  # GQA 7
    ("Llama-3.1-8B", 32, 8, 128, 128),
    ("Mistral-7B", 32, 8, 128, 128),
    # MLA, absorbed (the round's verify): every head over the one latent, 512 + 64 wide, values 512
    ("DeepSeek-V3 (128 heads, TP 1)", 128, 1, 576, 512),
    ("Kimi K2.6 (64 heads, TP 1) / DeepSeek-V3 TP 2", 64, 1, 576, 512),
    ("Kimi K2.6 TP 2", 32, 1, 576, 512),
    ("Kimi K2.6 TP 8", 8, 1, 576, 512),
]
# every tree of a budget up to 256 (root + drafted), the DFlash block, and prefill chunks
QUERIES = sorted({*range(1, 258), *node_ladder(256), 16, 512, 1024, 2048, 4096, 8192})
CAPABILITIES = [(8, 0), (9, 0), (10, 0), (12, 0)]  # A100, H100/H200, B200/B300, RTX 50
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
KV_BLOCK = 16  # the pool's block: the block mask's key tile


@functools.cache
def torch_configs(head_dim: int, dtype: torch.dtype, capability: tuple[int, int]) -> tuple[list, list]:
    """torch's own CUDA config tables at ``capability``: (decode configs, main-kernel configs)."""
    with mock.patch("torch.cuda.get_device_capability", return_value=capability):
        heuristic = CUDAConfigHeuristic()
        decode = heuristic.get_flex_decode_configs(head_dim, dtype)
        return decode, heuristic.get_flex_attn_fwd_configs(head_dim, dtype)


def lowered(
    queries: int, group: int, head_dim: int, dtype: torch.dtype, options: dict, kv_block: int, capability
) -> tuple[str, int, int]:
    """The kernel torch 2.13 lowers a CUDA ``flex_attention`` to and its (BLOCK_M, BLOCK_N); raises
    AssertionError where torch would refuse (no config left, a template assertion)."""
    q_block = FLEX_Q_BLOCK
    decode_configs, main_configs = torch_configs(head_dim, dtype, capability)
    # flex_decoding.py:40-93 (_use_flex_decoding): under 128 queries, a power-of-two group, not forced
    # (static batch and heads, and a block mask with one head: ddtree's always are)
    if queries < 128 and is_power_of_2(group) and not options.get("FORCE_USE_FLEX_ATTENTION", False):
        # flex_decoding.py:278-293: BLOCK_M defaults to next_power_of_2(queries * group), at least 16
        block_m = options.get("BLOCK_M", max(next_power_of_2(queries * group), 16))
        chosen = []
        for conf in decode_configs:
            block_n = min(conf.block_n, kv_block)  # flex_decoding.py:327-328
            if q_block % block_m or kv_block % block_n:  # flex_decoding.py:330-334: config skipped
                continue
            chosen.append(options.get("BLOCK_N", block_n))  # flex_decoding.py:345 (setdefault)
        assert chosen, f"no decode config: Q tile {q_block} % BLOCK_M {block_m}"
        block_n = chosen[0]
        assert kv_block >= block_n and kv_block % block_n == 0  # flex_decode.py.jinja:32 (static_assert)
        assert block_m % group == 0  # flex_decode.py.jinja:83 (device_assert)
        assert is_power_of_2(block_m) and block_m >= 16  # tl.arange's and tl.dot's sizes
        return "decode", block_m, block_n
    chosen = []
    for conf in main_configs:
        block_m = options.get("BLOCK_M", conf.block_m)  # flex_attention.py:443-444 (setdefault)
        block_n = options.get("BLOCK_N", conf.block_n)
        if kv_block % block_n or q_block % block_m:  # flex_attention.py:449-461: ValueError or skipped
            continue
        chosen.append((block_m, block_n))
    assert chosen, f"no flex config: KV tile {kv_block} % BLOCK_N {main_configs[0].block_n}"
    block_m, block_n = chosen[0]
    assert q_block >= block_m and kv_block >= block_n  # flex_attention.py.jinja:32-33 (static_assert)
    return "main", block_m, block_n


def test_torch_still_states_the_tile_constraints_the_choice_is_checked_against():
    """The lines ``lowered`` restates, read from the installed torch: a torch that changes them fails here
    first (then ``lowered`` and ``flex_kernel_options`` need a new reading)."""
    templates = Path(torch_flex.__file__).parent / "templates"
    main = (templates / "flex_attention.py.jinja").read_text()
    decode = (templates / "flex_decode.py.jinja").read_text()
    q_tiles = "tl.static_assert(SPARSE_Q_BLOCK_SIZE >= BLOCK_M and SPARSE_Q_BLOCK_SIZE % BLOCK_M == 0)"
    kv_tiles = "tl.static_assert(SPARSE_KV_BLOCK_SIZE >= BLOCK_N and SPARSE_KV_BLOCK_SIZE % BLOCK_N == 0)"
    assert q_tiles in main and kv_tiles in main and kv_tiles in decode
    assert "tl.device_assert(BLOCK_M % G == 0)" in decode
    choose = inspect.getsource(torch_decode._use_flex_decoding)
    assert "sympy.Lt(query.get_size()[-2], 128)" in choose and "ratio & (ratio - 1)" in choose
    lowering = inspect.getsource(torch_decode.create_flex_decoding_kernel)
    assert 'if SPARSE_Q_BLOCK_SIZE % kernel_options["BLOCK_M"] != 0:' in lowering
    assert "conf.block_n = SPARSE_KV_BLOCK_SIZE" in lowering
    assert 'cur_kernel_options["SPARSE_KV_BLOCK_SIZE"] % cur_kernel_options["BLOCK_N"]' in inspect.getsource(
        torch_flex.flex_attention
    )


def test_without_chosen_tiles_torch_refuses_the_shapes_the_issue_names():
    """Today's call (no kernel options) fails where issue 34 says: a group-8 tree past 16 nodes, any
    non-power-of-two group (Qwen2.5-7B, Qwen3-14B) and any tree of 128+ nodes; Qwen3-8B at budget 16 fits."""
    h200 = (9, 0)
    assert lowered(17, 4, 128, torch.bfloat16, {}, KV_BLOCK, h200)[0] == "decode"  # Qwen3-8B, budget 16
    for queries, group in [(33, 4), (17, 8), (2, 7), (2, 5), (129, 4)]:
        with pytest.raises(AssertionError, match="no "):
            lowered(queries, group, 128, torch.bfloat16, {}, KV_BLOCK, h200)


@pytest.mark.parametrize(("name", "heads", "kv_heads", "head_dim", "v_dim"), REAL, ids=[r[0] for r in REAL])
def test_chosen_tiles_compile_for_every_real_shape_size_dtype_and_gpu(name, heads, kv_heads, head_dim, v_dim):
    group = heads // kv_heads
    for queries in QUERIES:
        options = flex_kernel_options(queries, heads, kv_heads, KV_BLOCK)
        for capability in CAPABILITIES:
            for dtype in DTYPES:
                kernel, block_m, _ = lowered(queries, group, head_dim, dtype, options, KV_BLOCK, capability)
                if kernel == "decode":  # a program holds whole groups: its rows never exceed the tile
                    assert group <= block_m <= FLEX_Q_BLOCK, (name, queries)


@pytest.mark.parametrize("kv_block", [16, 32, 48, 64, 128, 256])
def test_chosen_key_step_divides_any_block_size_that_is_a_multiple_of_16(kv_block):
    for queries, group in [(1, 1), (17, 4), (2, 7), (257, 8), (9, 64)]:
        options = flex_kernel_options(queries, group * 2, 2, kv_block)
        lowered(queries, group, 128, torch.bfloat16, options, kv_block, (9, 0))


def test_a_block_size_flex_cannot_tile_on_cuda_is_refused_in_one_line():
    with pytest.raises(DDTreeError, match="multiple of 16, got 8"):
        flex_kernel_options(17, 32, 8, 8)


# -- SDPA ----------------------------------------------------------------------------------------------


def test_masked_gqa_on_cuda_expands_the_kv_heads_and_never_asks_for_enable_gqa():
    keys, values = torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 8)
    for heads in (2, 4, 14):
        for masked in (True, False):
            for device in ("cuda", "cpu"):
                k, v, gqa = sdpa_operands(keys, values, heads, masked, device)
                assert not (gqa and masked and device == "cuda")  # the math kernel's only combination
                expanded = device == "cuda" and masked and heads > 2
                assert k.shape[1] == (heads if expanded else 2) and v.shape[1] == k.shape[1]
                assert gqa == (heads > 2 and not expanded)
                if not expanded:  # the CPU's call, and flash's unmasked GQA, are untouched
                    assert k is keys and v is values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expanded_kv_heads_give_exactly_the_gqa_output(dtype):
    torch.manual_seed(0)
    q = torch.randn(3, 8, 17, 64, dtype=dtype)  # [B, heads, T, D]
    keys, values = torch.randn(3, 2, 96, 64, dtype=dtype), torch.randn(3, 2, 96, 64, dtype=dtype)
    mask = torch.rand(3, 1, 17, 96) < 0.7
    mask[..., 0] = True  # every query sees a column
    gqa = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    k, v, flag = sdpa_operands(keys, values, 8, True, "cuda")
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=flag), gqa)
