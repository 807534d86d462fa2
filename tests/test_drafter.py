"""The DFlash drafter: checkpoint format, round trip, default feature layers, pairing checks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.model.kv_cache import KVLayout, PagedKVCache
from ddtree.speculative.drafter import DFlashDrafter, default_target_layer_ids, dflash_config
from tests.conftest import MASK, tiny_drafter, tiny_target


def drafter_outputs(drafter: DFlashDrafter, target) -> torch.Tensor:
    torch.manual_seed(0)
    block = torch.tensor([[3] + [MASK] * (drafter.block_size - 1)])
    features = torch.randn(1, 5, len(drafter.target_layer_ids) * target.config.hidden_size)
    with torch.inference_mode():
        return drafter(
            target.get_input_embeddings()(block),
            features,
            block_positions=torch.arange(5, 5 + drafter.block_size)[None],
            ctx_positions=torch.arange(5)[None],
        )


def test_save_then_load_gives_identical_outputs(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    torch.testing.assert_close(
        drafter_outputs(loaded, target), drafter_outputs(drafter, target), rtol=0, atol=0
    )


def test_checkpoint_uses_the_public_dflash_format(tmp_path):
    target = tiny_target()
    tiny_drafter(target, num_layers=2).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 8 and config["num_target_layers"] == 4
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 1]}
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    per_layer = [
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight",
    ]  # fmt: skip
    expected = {f"layers.{i}.{k}" for i in range(2) for k in per_layer} | {
        "fc.weight", "hidden_norm.weight", "norm.weight"
    }  # fmt: skip
    assert keys == expected


@pytest.mark.parametrize(
    ("target_layers", "draft_layers", "expected"),
    [(36, 5, [1, 9, 17, 25, 33]), (28, 1, [14]), (4, 2, [1, 1]), (32, 3, [1, 15, 29])],
)
def test_default_target_layer_ids_follow_dflash(target_layers, draft_layers, expected):
    assert default_target_layer_ids(target_layers, draft_layers) == expected


def test_context_cache_equals_recomputing_the_context():
    """Feeding the context in two chunks through a paged cache equals feeding it at once, and a second
    request of the same pool, padded, in other blocks, gives the same block."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    torch.manual_seed(0)
    features = torch.randn(1, 9, drafter.fc.in_features)
    block = target.get_input_embeddings()(torch.tensor([[3] + [MASK] * 7]))
    positions = torch.arange(9, 17)[None]
    attn = drafter.layers[0].self_attn
    cache = PagedKVCache(
        len(drafter.layers), 16, 4, 8, KVLayout.gqa(attn.num_kv_heads, attn.head_dim), torch.float32, "cpu"
    )  # 15 blocks of 4 columns (block 0 is scratch), tables of 8 entries
    first_table = torch.tensor([[7, 3, 12, 1, 5, 0, 0, 0, 0]])  # scattered, out of order
    other_table = torch.tensor([[2, 9, 14, 4, 11, 0, 0, 0, 0]])

    def mask(end: int, span: int) -> torch.Tensor:
        return (torch.arange(span) < end)[None, None, None]  # [1, 1, 1, span]

    with torch.inference_mode():
        whole = drafter(block, features, positions, torch.arange(9)[None])
        first = cache.at(first_table, torch.arange(12)[None], span=12)  # 4 context + 8 block columns
        drafter(block, features[:, :4], torch.arange(4, 12)[None], torch.arange(4)[None], first)
        second = cache.at(first_table, torch.arange(4, 17)[None], span=20)  # 5 more context, the block
        chunked = drafter(block, features[:, 4:], positions, torch.arange(4, 9)[None], second, mask(17, 20))
        # Another request: same context, padded by 3 features that go to the scratch column.
        padded = torch.cat((features, torch.randn(1, 3, features.shape[2])), dim=1)
        cols = torch.cat((torch.arange(9), torch.full((3,), cache.scratch), torch.arange(9, 17)))[None]
        ctx_positions = torch.cat((torch.arange(9), torch.zeros(3, dtype=torch.long)))[None]
        write = cache.at(other_table, cols, 20)
        row = drafter(block, padded, positions, ctx_positions, write, mask(17, 20))
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(row, whole, atol=1e-5, rtol=0)


def mismatched(target, **overrides) -> DFlashDrafter:
    fields = {"num_layers": 1, "block_size": 8, "mask_token_id": MASK} | overrides
    return DFlashDrafter(dflash_config(target.config, **fields))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 32}, "hidden size"),
        ({"target_layer_ids": [7]}, "outside the target"),
        ({"mask_token_id": None}, "mask_token_id"),
        ({"mask_token_id": 999}, "mask_token_id"),
    ],
)
def test_drafter_that_does_not_fit_the_target_is_refused(overrides, message):
    target = tiny_target()
    with pytest.raises(DDTreeError, match=message):
        Engine(target, mismatched(target, **overrides))
