"""DFlash2 drafters in the public format (``DFlash2DraftModel``): checkpoints written here tensor by tensor
from the public names and shapes load, round-trip and decode losslessly; the grouped dynamic convolution
and the selector's edge scores match references written from the math; bad checkpoints are refused in
one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.model.loader import DEFAULT_TARGET, load_drafter, load_target
from ddtree.request.params import SamplingParams
from ddtree.speculative.dflash2 import DFlash2Drafter, GroupedDynamicConv
from ddtree.speculative.drafter import DFlashDrafter
from tests.conftest import builtin_dflash

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "for i in range(10):"]
NEW = 24
SELECTOR = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def builtin():
    target, tokenizer = load_target(DEFAULT_TARGET)
    return target, tokenizer


def public_config(base: dict, **dflash) -> dict:
    """A public DFlash2 config.json over a DFlash one: block size only in dflash_config, sliding layers
    made bidirectional (``is_causal: false``) with a window past the context, bf16."""
    config = {k: v for k, v in base.items() if k != "block_size"}
    layers = config["num_hidden_layers"]
    window = 2 * config["max_position_embeddings"]
    config |= dict(architectures=["DFlash2DraftModel"], model_type="qwen3", dtype="bfloat16", is_causal=False)
    config |= dict(layer_types=["sliding_attention"] * layers, sliding_window=window, use_sliding_window=True)
    config["dflash_config"] = {
        **base["dflash_config"],
        "block_size": base["block_size"],
        **SELECTOR,
        **dflash,
    }
    return config


def public_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a public DFlash2 checkpoint and its shape (the published safetensors header)."""
    h, v, d = config["hidden_size"], config["vocab_size"], config["dflash_config"]
    inter, head = config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    taps, groups = d["conv_kernel_size"], h // d["conv_group_size"]
    per_layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (head,),
        "self_attn.k_norm.weight": (head,),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    for conv in ("attention_conv", "mlp_conv"):
        per_layer[f"{conv}.base_kernel"] = (2, taps, h)
        per_layer[f"{conv}.kernel_projection.weight"] = (2 * taps * groups, h)
    shapes = {f"layers.{i}.{k}": s for i in range(config["num_hidden_layers"]) for k, s in per_layer.items()}
    rank = d["selector_rank"]
    return shapes | {
        "fc.weight": (h, len(d["target_layer_ids"]) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
        "candidate_selector.predecessor_codebook": (v, rank),
        "candidate_selector.successor_codebook": (v, rank),
        "candidate_selector.hidden_projection.weight": (rank, h),
    }


def random_weights(config: dict, seed: int = 0, start: dict | None = None) -> dict[str, torch.Tensor]:
    """Random bf16 tensors for every public name (norms near 1, matrices at std 0.05); ``start``'s tensors
    are kept, and then each convolution is the identity (tap 0 = 1, no dynamic part)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in public_shapes(config).items():
        value = torch.randn(shape, generator=generator)
        if name.endswith("norm.weight"):
            value = 1 + 0.1 * value
        elif "codebook" not in name:
            value = 0.05 * value
        weights[name] = value.to(torch.bfloat16)
    if start is not None:
        weights |= start
        for name in [n for n in weights if "_conv." in n]:
            weights[name] = torch.zeros_like(weights[name])
            if name.endswith("base_kernel"):
                weights[name][:, 0] = 1
    return weights


def write(directory: Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints for the built-in target: ``dflash`` (a DFlash drafter, ``builtin_dflash``) and two
    DFlash2 ones, ``random`` (every tensor random, a scaled and capped head, scaled embeddings) and
    ``converted`` (the DFlash drafter's tensors, identity convolutions, a random selector)."""
    root = tmp_path_factory.mktemp("dflash2")
    dflash = builtin_dflash(root)
    base = json.loads((dflash / "config.json").read_text())
    scaled = dict(input_embedding_scale=1.5, output_multiplier=0.2, final_logit_softcapping=20.0)
    random_config = public_config(base, **scaled)
    converted_config = public_config(base)
    builtin_weights = load_file(str(dflash / "model.safetensors"))
    return {
        "dflash": dflash,
        "random": write(root / "random", random_config, random_weights(random_config)),
        "converted": write(
            root / "converted", converted_config, random_weights(converted_config, 1, builtin_weights)
        ),
    }


def block_hidden(drafter, target, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    block = torch.tensor([[7] + [drafter.mask_token_id] * (drafter.block_size - 1)] * 2)
    features = torch.randn(
        2, 5, len(drafter.target_layer_ids) * target.config.hidden_size, generator=generator
    )
    with torch.inference_mode():
        return drafter(
            target.get_input_embeddings()(block),
            features,
            block_positions=torch.arange(5, 5 + drafter.block_size).expand(2, -1),
            ctx_positions=torch.arange(5).expand(2, -1),
        )


# -- loading -----------------------------------------------------------------------------------------------


def test_public_checkpoints_load_every_tensor(checkpoints):
    for directory in (checkpoints["random"], checkpoints["converted"]):
        drafter = load_drafter(directory)
        assert isinstance(drafter, DFlash2Drafter) and drafter.block_size == 16
        stored = load_file(str(directory / "model.safetensors"))
        state = drafter.state_dict()
        assert set(stored) == {k for k in state if "rotary_emb" not in k}
        for name, tensor in stored.items():
            torch.testing.assert_close(state[name], tensor.float(), rtol=0, atol=0)
    drafter = load_drafter(checkpoints["random"])
    assert drafter.settings.input_embedding_scale == 1.5 and drafter.settings.softcap == 20.0


def test_identity_convolutions_reproduce_the_dflash_drafter(builtin, checkpoints):
    target, _ = builtin
    dflash = load_drafter(checkpoints["dflash"])
    dflash2 = load_drafter(checkpoints["converted"])
    assert type(dflash) is DFlashDrafter
    torch.testing.assert_close(block_hidden(dflash2, target), block_hidden(dflash, target), rtol=0, atol=0)


def test_save_then_load_round_trips_in_the_public_format(builtin, checkpoints, tmp_path):
    target, _ = builtin
    drafter = load_drafter(checkpoints["random"])
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert (
        config["dflash_config"].items()
        >= json.loads((checkpoints["random"] / "config.json").read_text())["dflash_config"].items()
    )
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in stored.items()} == public_shapes(config)
    again = load_drafter(tmp_path)
    torch.testing.assert_close(block_hidden(again, target), block_hidden(drafter, target), rtol=0, atol=0)


# -- greedy output is the target's -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "converted"])
def test_greedy_methods_emit_the_same_tokens(builtin, checkpoints, kind):
    target, tokenizer = builtin
    drafter = load_drafter(checkpoints[kind])
    params = SamplingParams(max_new_tokens=NEW)
    outputs, accepted = {}, 0
    for method in ("ar", "dflash", "ddtree"):
        engine = Engine(target, drafter, tokenizer, method=method, budget=16, max_num_seqs=len(PROMPTS))
        results = engine.generate(PROMPTS, params)
        outputs[method] = [r.token_ids for r in results]
        accepted += sum(n > 1 for r in results for n in r.stats.acceptance_lengths)
    assert outputs["dflash"] == outputs["ar"] and outputs["ddtree"] == outputs["ar"]
    assert all(len(tokens) == NEW for tokens in outputs["ar"])
    if kind == "converted":
        assert accepted > 10  # the trained layers draft well: the tree path ran


def test_engine_from_pretrained_loads_a_dflash2_drafter(checkpoints):
    params = SamplingParams(max_new_tokens=12)
    plain = Engine.from_pretrained(DEFAULT_TARGET, checkpoints["converted"], method="ar")
    tree = Engine.from_pretrained(DEFAULT_TARGET, checkpoints["converted"], method="ddtree", budget=16)
    assert isinstance(tree.runner.drafter, DFlash2Drafter)
    assert tree.generate(PROMPTS[0], params).token_ids == plain.generate(PROMPTS[0], params).token_ids


# -- the math ----------------------------------------------------------------------------------------------


def reference_conv(inputs: torch.Tensor, base: torch.Tensor, d: torch.Tensor, group: int) -> torch.Tensor:
    """out[b, s, ch] = sum over taps t <= s of (base[t, ch] + d[b, s, t, ch // group]) * in[b, s - t, ch]."""
    expected = torch.zeros_like(inputs)
    batch, length, hidden = inputs.shape
    for b in range(batch):
        for s in range(length):
            for t in range(min(base.shape[0], s + 1)):
                for channel in range(hidden):
                    weight = base[t, channel] + d[b, s, t, channel // group]
                    expected[b, s, channel] += weight * inputs[b, s - t, channel]
    return expected


def test_grouped_dynamic_convolution_matches_its_definition():
    torch.manual_seed(0)
    hidden, taps, group = 12, 3, 4
    conv = GroupedDynamicConv(hidden, taps, group)
    torch.nn.init.normal_(conv.base_kernel)
    x, y = torch.randn(2, 5, hidden), torch.randn(2, 5, hidden)
    prepared, coefficients = conv.prepare(x)
    d = (x @ conv.kernel_projection.weight.T).view(2, 5, 2, taps, hidden // group)
    expected = reference_conv(x, conv.base_kernel[0], d[:, :, 0], group)
    torch.testing.assert_close(prepared, expected, rtol=1e-5, atol=1e-5)
    expected = reference_conv(y, conv.base_kernel[1], d[:, :, 1], group)
    torch.testing.assert_close(conv.finish(y, coefficients), expected, rtol=1e-5, atol=1e-5)


def test_a_layer_wraps_attention_and_mlp_in_their_convolutions(checkpoints):
    """x + conv1(attn(conv0(norm(x)))), then the same around the MLP; both sides' taps from norm(x)."""
    drafter = load_drafter(checkpoints["random"])
    layer, group = drafter.layers[0], drafter.settings.group_size
    torch.manual_seed(0)
    x, ctx = torch.randn(1, 4, 256), torch.randn(1, 3, 256)
    rope = drafter.rotary_emb(ctx, torch.arange(7)[None])

    def wrapped(conv, inputs, module):
        d = (inputs @ conv.kernel_projection.weight.T).view(1, 4, 2, drafter.settings.taps, -1)
        inner = module(reference_conv(inputs, conv.base_kernel[0], d[:, :, 0], group))
        return reference_conv(inner, conv.base_kernel[1], d[:, :, 1], group)

    with torch.inference_mode():
        attention = lambda h: layer.self_attn(h, ctx, rope, None, None)  # noqa: E731
        h = x + wrapped(layer.attention_conv, layer.input_layernorm(x), attention)
        expected = h + wrapped(layer.mlp_conv, layer.post_attention_layernorm(h), layer.mlp)
        got = layer(x, ctx, rope, None, None)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_block_embeddings_are_scaled(builtin, checkpoints):
    target, _ = builtin
    drafter = load_drafter(checkpoints["random"])
    scaled = block_hidden(drafter, target)
    drafter.settings = dataclasses.replace(drafter.settings, input_embedding_scale=1.0)
    embedding = target.get_input_embeddings()
    target.model.embed_tokens = torch.nn.Embedding.from_pretrained(embedding.weight * 1.5)
    try:
        torch.testing.assert_close(block_hidden(drafter, target), scaled)
    finally:
        target.model.embed_tokens = embedding


def test_edge_scores_match_the_low_rank_pair_score(builtin, checkpoints):
    target, _ = builtin
    drafter = load_drafter(checkpoints["random"])
    hidden = block_hidden(drafter, target)  # [2, S, H]
    head = target.lm_head.weight.detach()
    ids, logits = drafter.candidates(hidden, head)
    plain = hidden[:, 1:] @ head.T
    torch.testing.assert_close(ids, plain.topk(drafter.settings.top_k, dim=-1).indices)
    torch.testing.assert_close(logits, 20.0 * torch.tanh(0.2 * plain.gather(-1, ids) / 20.0))
    anchors = torch.tensor([7, 7])
    scores = drafter.edge_scores(hidden, ids, logits, anchors)
    b_, length, k = ids.shape
    assert scores.shape == (b_, length, k, k)
    state = drafter.state_dict()
    predecessor = state["candidate_selector.predecessor_codebook"]
    successor = state["candidate_selector.successor_codebook"]
    projection = state["candidate_selector.hidden_projection.weight"]
    for b in range(b_):
        for position in range(length):
            z = projection @ hidden[b, position + 1]
            for p in range(k):
                before = anchors[b] if position == 0 else ids[b, position - 1, p]
                for c in range(k):
                    pair = (predecessor[before] * z * successor[ids[b, position, c]]).sum()
                    expected = logits[b, position, c] + pair
                    torch.testing.assert_close(scores[b, position, p, c], expected, rtol=1e-4, atol=1e-4)
    normalized = drafter.edge_log_probs(hidden, ids, logits, anchors)
    torch.testing.assert_close(normalized.exp().sum(-1), torch.ones(b_, length, k))


def test_a_sampled_rows_lattice_edges_are_the_whole_vocabularys_conditional(builtin, checkpoints):
    """A sampled row's edge (p -> c) is the probability of c after p over the whole vocabulary: each
    candidate's edge score, every other token its draft logit (the oracle builds that distribution token by
    token). A greedy row's edges stay normalised over the candidates, bit for bit as without the flag."""
    target, _ = builtin
    drafter = load_drafter(checkpoints["random"])
    hidden = block_hidden(drafter, target)  # [2, S, H]
    head = target.lm_head.weight.detach()
    logits = hidden[:, 1:] @ head.T  # [2, L, V] the LM head's, as the engine passes them
    anchors = torch.tensor([7, 9])
    plain_ids, plain_edges = drafter.lattice(hidden[:, 1:], logits, anchors)
    ids, edges = drafter.lattice(hidden[:, 1:], logits, anchors, [0])
    assert torch.equal(ids, plain_ids) and torch.equal(edges[1], plain_edges[1])
    scores = drafter.edge_scores(hidden, ids, drafter.draft_logits(logits).gather(-1, ids), anchors)
    drafted = drafter.draft_logits(logits)[0].double()  # [L, V]
    _, length, k = ids.shape
    for position in range(length):
        for p in range(k):
            law = drafted[position].clone()  # [V]: the non-candidates keep their draft logits
            law[ids[0, position]] = scores[0, position, p].double()
            expected = torch.log_softmax(law, dim=-1)[ids[0, position]]  # [K]
            torch.testing.assert_close(edges[0, position, p].double(), expected, rtol=0, atol=2e-5)
    assert (edges[0].exp().sum(-1) < 1 - 1e-3).all()  # the candidates do not hold all the mass here


# -- a Qwen3-sized vocabulary ------------------------------------------------------------------------------


def test_a_151936_token_vocabulary_loads_and_decodes(tmp_path):
    vocab = 151936
    torch.manual_seed(0)
    fields = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16)
    fields |= dict(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    target = Qwen3ForCausalLM(Qwen3Config(**fields, initializer_range=0.3)).eval()
    base = dict(fields, num_hidden_layers=1, num_target_layers=2, block_size=8)
    base["dflash_config"] = {"mask_token_id": 5, "target_layer_ids": [1]}
    config = public_config(base)
    drafter = load_drafter(write(tmp_path / "d", config, random_weights(config)))
    assert drafter.candidate_selector.successor_codebook.shape == (vocab, SELECTOR["selector_rank"])
    prompt = [[11, 150000, 42, 99999]]
    params = SamplingParams(max_new_tokens=8)
    plain = Engine(target, drafter, method="ar").generate(prompt, params)[0].token_ids
    assert Engine(target, drafter, method="ddtree", budget=16).generate(prompt, params)[0].token_ids == plain


# -- refusals ----------------------------------------------------------------------------------------------


def refusal(directory: Path) -> str:
    with pytest.raises(DDTreeError) as info:
        load_drafter(directory)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"conv_group_size": 24}, "conv_group_size 24 does not divide hidden_size 256"),
        ({"selector_rank": None}, "missing dflash_config selector_rank"),
        ({"conv_kernel_size": 0}, "needs positive conv_kernel_size 0"),
        ({"selector_top_k": 5000}, "selector_top_k 5000 exceeds vocab_size 4096"),
        ({"output_multiplier": -1.0}, "output_multiplier must be positive"),
        ({"conv_group_size": "wide"}, "non-numeric"),
    ],
)
def test_a_bad_dflash2_config_is_one_line(checkpoints, tmp_path, changes, fragment):
    config = json.loads((checkpoints["random"] / "config.json").read_text())
    draft = {k: v for k, v in (config["dflash_config"] | changes).items() if v is not None}
    weights = load_file(str(checkpoints["random"] / "model.safetensors"))
    assert fragment in refusal(write(tmp_path, config | {"dflash_config": draft}, weights))


@pytest.mark.parametrize("damage", ["missing", "unexpected", "shape"])
def test_a_malformed_checkpoint_is_one_line(checkpoints, tmp_path, damage):
    config = json.loads((checkpoints["random"] / "config.json").read_text())
    weights = load_file(str(checkpoints["random"] / "model.safetensors"))
    name = "candidate_selector.successor_codebook"
    if damage == "missing":
        del weights[name]
    elif damage == "unexpected":
        weights["candidate_selector.bias"] = torch.zeros(3)
    else:
        weights[name] = weights[name][:, :-1].contiguous()
    message = refusal(write(tmp_path, config, weights))
    assert "do not" in message and (name in message or "candidate_selector.bias" in message)


def test_a_plain_dflash_architecture_name_is_still_required(checkpoints, tmp_path):
    config = json.loads((checkpoints["random"] / "config.json").read_text())
    weights = load_file(str(checkpoints["random"] / "model.safetensors"))
    message = refusal(write(tmp_path, config | {"architectures": ["Qwen3ForCausalLM"]}, weights))
    assert "must name DFlashDraftModel or DFlash2DraftModel" in message
