"""Tensor parallelism (Megatron-LM's split of the target): two gloo ranks on the CPU, each with half the
heads, half the KV cache (MLA: the whole latent) and half the MLP (MoE: half the routed experts, half the
shared ones), match the unsharded forward's hidden states, drafter features, logits and greedy tokens; a
target whose heads or experts do not split evenly is refused in one line."""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from ddtree.errors import DDTreeError
from ddtree.model.forward import TargetForward
from ddtree.model.kv_cache import PagedKVCache
from ddtree.model.tensor_parallel import TPGroup, shard_target
from tests.conftest import deepseek_v3_fields, tiny_moe_target, tiny_target

WORLD = 2
ARCHS = ("qwen3", "qwen2", "llama")  # qwen2: q/k/v biases; llama (as built here): o_proj and MLP biases too
# Qwen3-MoE with a dense layer 0; DeepSeek-V3 (MLA with and without q_lora, shared experts, a dense layer
# 0); GLM-4 MoE (qkv biases, shared experts, a dense layer 0)
MOE_ARCHS = ("qwen3_moe", "deepseek_v3", "deepseek_v3_no_q_lora", "glm4_moe")
PROMPTS = [[5, 17, 230, 999, 4, 61, 8], [42, 3, 700]]  # right-padded into one prefill
STEPS = 4  # greedy steps after the prefill
FEATURE_LAYERS = [0, 1]
TIMEOUT = 90  # seconds for both ranks, start-up included; a hung collective fails the test


def small_target(arch: str) -> nn.Module:
    """The same 2-layer float32 target in every process (GQA 4/2, head_dim 32, vocab 1000; the MoE ones:
    ``tiny_moe_target``'s 3 layers, 8 routed experts, top-2), its biases random: HF initialises them to
    zero, which would hide a bias sliced or summed wrong."""
    if arch in MOE_ARCHS:
        return random_biases(tiny_moe_target(arch, vocab=1000))
    torch.manual_seed(0)
    fields = dict(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**fields))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**fields))
    else:
        model = LlamaForCausalLM(LlamaConfig(**fields, attention_bias=True, mlp_bias=True))
    return random_biases(model)


def random_biases(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.2)
    return model.eval()


def greedy(model: nn.Module, forward: TargetForward) -> dict[str, torch.Tensor]:
    """A right-padded prefill of ``PROMPTS`` over a paged KV cache (laid out for ``forward``'s KV heads),
    then ``STEPS`` greedy steps: the prefill's final hidden states and drafter features, every step's
    logits and tokens."""
    b, bs, width = len(PROMPTS), 16, 2
    cache = PagedKVCache(
        len(forward.layers),
        1 + b * width,
        bs,
        width,
        forward.layout,
        torch.float32,
        "cpu",
    )
    tables = torch.zeros(b, width + 1, dtype=torch.int64)  # [B, width + 1]; the last entry: scratch
    tables[:, :width] = 1 + torch.arange(b * width).view(b, width)  # block 0 is the scratch block
    span = cache.capacity
    keys = torch.arange(span)  # [span]
    lengths = torch.tensor([len(p) for p in PROMPTS])  # [B]
    ids = torch.zeros(b, int(lengths.max()), dtype=torch.int64)  # [B, P]
    for i, prompt in enumerate(PROMPTS):
        ids[i, : len(prompt)] = torch.tensor(prompt)
    positions = torch.arange(ids.shape[1]).expand(b, -1)  # [B, P]
    ends = lengths[:, None]  # [B, 1]
    cols = torch.where(positions < ends, positions, cache.scratch)  # padding writes the scratch column
    mask = ((keys <= positions[:, :, None]) & (keys < ends[:, :, None]))[:, None]  # [B, 1, P, span]
    rows = torch.arange(b)
    with torch.inference_mode():
        hidden, features = forward(ids, positions, cache.at(tables, cols, span), mask, FEATURE_LAYERS)
        logits = [model.lm_head(hidden[rows, lengths - 1])]  # [B, V] each
        tokens = [logits[-1].argmax(-1)]  # [B] each
        for step in range(STEPS):
            pos = (lengths + step)[:, None]  # [B, 1]: the column of the token just chosen
            step_mask = (keys <= pos[:, :, None])[:, None]  # [B, 1, 1, span]
            h, _ = forward(tokens[-1][:, None], pos, cache.at(tables, pos, span), step_mask)
            logits.append(model.lm_head(h[:, 0]))
            tokens.append(logits[-1].argmax(-1))
    return {
        "hidden": hidden,  # [B, P, H]
        "features": features,  # [B, P, F * H]
        "logits": torch.stack(logits, 1),  # [B, STEPS + 1, V]
        "tokens": torch.stack(tokens, 1),  # [B, STEPS + 1]
        "heads": torch.tensor(forward.num_heads),
        "cache_bytes": torch.tensor(cache.nbytes()),
    }


def rank_main(rank: int, port: int, out: str) -> None:
    """One rank: shard each target, decode, save what it saw for the parent to compare."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=TIMEOUT),
    )
    try:
        results = {}
        for arch in ARCHS + MOE_ARCHS:
            model = small_target(arch)
            shard_target(model, rank, WORLD)
            results[arch] = greedy(model, TargetForward(model, TPGroup(rank, WORLD)))
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every rank's results, from one spawn of ``WORLD`` gloo processes (a rank that raises fails here with
    its traceback; one that hangs is killed at ``TIMEOUT``)."""
    out = tmp_path_factory.mktemp("tp")
    context = mp.start_processes(
        rank_main, args=(free_port(), str(out)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"the {WORLD} tensor-parallel ranks did not finish within {TIMEOUT} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("arch", ARCHS + MOE_ARCHS)
def test_sharded_forward_matches_the_unsharded_one(ranks, arch):
    model = small_target(arch)
    expected = greedy(model, TargetForward(model))
    mla = "deepseek" in arch  # the latent, shared by every head, is every rank's whole: one process's size
    for rank, results in enumerate(ranks):
        got = results[arch]
        assert int(got["heads"]) == model.config.num_attention_heads // WORLD
        cache_bytes = int(expected["cache_bytes"]) // (1 if mla else WORLD)  # GQA: half the KV heads
        assert int(got["cache_bytes"]) == cache_bytes
        for name in ("hidden", "features", "logits"):
            diff = (got[name] - expected[name]).abs().max().item()
            assert diff <= 1e-4, f"rank {rank}'s {name} differ from the unsharded forward's by {diff}"
        assert torch.equal(got["tokens"], expected["tokens"])
    # the all-reduces leave one residual stream: every rank's is the same, bit for bit
    assert all(torch.equal(r[arch]["hidden"], ranks[0][arch]["hidden"]) for r in ranks)


def test_shards_keep_their_heads_slice_and_one_copy_of_each_bias():
    full = small_target("llama")
    attn, mlp = full.model.layers[0].self_attn, full.model.layers[0].mlp
    for rank in range(WORLD):
        model = small_target("llama")
        shard_target(model, rank, WORLD)
        a, m = model.model.layers[0].self_attn, model.model.layers[0].mlp
        q, kv, inter = 64, 32, 128  # 2 of 4 heads, 1 of 2 KV heads (head_dim 32), 128 of 256 units
        assert torch.equal(a.q_proj.weight, attn.q_proj.weight[rank * q : (rank + 1) * q])
        assert torch.equal(a.k_proj.bias, attn.k_proj.bias[rank * kv : (rank + 1) * kv])
        assert torch.equal(a.o_proj.weight, attn.o_proj.weight[:, rank * q : (rank + 1) * q])
        assert torch.equal(m.up_proj.weight, mlp.up_proj.weight[rank * inter : (rank + 1) * inter])
        assert torch.equal(m.down_proj.weight, mlp.down_proj.weight[:, rank * inter : (rank + 1) * inter])
        assert (a.o_proj.bias is not None, m.down_proj.bias is not None) == (rank == 0, rank == 0)


@pytest.mark.parametrize("arch", ("llama", *MOE_ARCHS))
def test_every_sharded_parameter_records_the_part_of_the_full_tensor_it_kept(arch):
    """``tp_slice`` is what a rank-by-rank loader reads from the checkpoint: it must index exactly the
    kept values, and sharding a meta model (no weights read yet) must record the same slices."""
    full = dict(small_target(arch).named_parameters())
    for rank in range(WORLD):
        model = small_target(arch)
        shard_target(model, rank, WORLD)
        with torch.device("meta"):
            empty = small_target(arch)
        shard_target(empty, rank, WORLD)
        slices = {name: p.tp_slice for name, p in empty.named_parameters() if hasattr(p, "tp_slice")}
        sharded = {name: p for name, p in model.named_parameters() if hasattr(p, "tp_slice")}
        assert slices.keys() == sharded.keys()
        for name, param in sharded.items():
            assert torch.equal(param, full[name][param.tp_slice]), name
            assert slices[name] == param.tp_slice and empty.get_parameter(name).shape == param.shape, name
            assert len(param.tp_slice) == full[name].dim(), name
        # every split is even: a rank keeps 1 / WORLD of what it slices, and the rest whole
        assert sum(p.numel() for p in sharded.values()) * WORLD == sum(full[n].numel() for n in sharded)
        for name, param in model.named_parameters():
            if name not in sharded:
                assert torch.equal(param, full[name]), name
        if arch == "llama":  # per layer: 7 weights, the q/k/v and gate/up biases (o/down: whole or absent)
            assert len(sharded) == 12 * model.config.num_hidden_layers


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_each_rank_holds_half_the_routed_experts(arch):
    """Rank r keeps routed experts [4 r, 4 r + 4) of 8, whole; the router stays whole on every rank."""
    full = small_target(arch)
    routed = sum(p.numel() for name, p in full.named_parameters() if ".experts." in name)
    total = sum(p.numel() for p in full.parameters())
    for rank in range(WORLD):
        model = small_target(arch)
        shard_target(model, rank, WORLD)
        held = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        assert held * WORLD == routed
        assert sum(p.numel() for p in model.parameters()) < total - routed // 2  # attention shrank too
        for layer, whole in zip(model.model.layers[1:], full.model.layers[1:], strict=True):
            experts = layer.mlp.experts
            assert experts.num_experts == 4 and experts.gate_up_proj.shape[0] == 4
            assert experts.down_proj.tp_slice == (slice(4 * rank, 4 * rank + 4), slice(None), slice(None))
            assert torch.equal(layer.mlp.gate.weight, whole.mlp.gate.weight)


@pytest.mark.parametrize(
    ("world", "message"),
    [
        (3, r"num_attention_heads \(4\) and num_key_value_heads \(2\) divisible by 3"),
        (4, r"num_key_value_heads \(2\) divisible by 4"),
    ],
)
def test_heads_that_do_not_split_evenly_are_refused_in_one_line(world, message):
    target = tiny_target()  # 4 heads, 2 KV heads
    with pytest.raises(DDTreeError, match=message) as info:
        shard_target(target, 0, world)
    assert "\n" not in str(info.value)
    assert target.model.layers[0].self_attn.q_proj.out_features == 4 * 16  # left whole


def deepseek_v3(**changes) -> nn.Module:
    """``tiny_moe_target("deepseek_v3")``'s config with ``changes``, on the meta device (nothing to read)."""
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(DeepseekV3Config(**deepseek_v3_fields() | changes))


@pytest.mark.parametrize(
    ("changes", "world", "message"),
    [
        ({"n_routed_experts": 6, "n_group": 1}, 4, r"the routed experts \(6\) divisible by 4"),
        ({"moe_intermediate_size": 20}, 8, r"size of layer 1's shared experts \(20\) divisible by 8"),
        ({"intermediate_size": 100}, 8, r"size of layer 0's MLP \(100\) divisible by 8"),
        ({}, 3, r"num_attention_heads \(8\) divisible by 3"),
    ],
)
def test_experts_and_sizes_that_do_not_split_evenly_are_refused_in_one_line(changes, world, message):
    target = deepseek_v3(num_attention_heads=8, **changes)
    with pytest.raises(DDTreeError, match=message) as info:
        shard_target(target, 0, world)
    assert "\n" not in str(info.value)
    assert target.model.layers[1].mlp.experts.num_experts == target.config.n_routed_experts  # left whole
    assert not any(hasattr(p, "tp_slice") for p in target.parameters())


def test_a_target_is_sharded_once():
    target = deepseek_v3()
    shard_target(target, 0, WORLD)
    with pytest.raises(DDTreeError, match="already sharded"):
        shard_target(target, 0, WORLD)


def test_a_moe_layer_of_other_parts_is_refused_in_one_line():
    """Qwen2-MoE gates its shared expert (``shared_expert_gate``): not a layout ``shard_target`` knows."""
    config = Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.device("meta"):
        target = Qwen2MoeForCausalLM(config)
    with pytest.raises(DDTreeError, match="layer 0's is a Qwen2MoeSparseMoeBlock") as info:
        shard_target(target, 0, WORLD)
    assert "\n" not in str(info.value)
