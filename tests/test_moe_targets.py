"""The MLA family (DeepSeek-V2/V3, Kimi K2 / K2.5) and GLM-4 MoE: every method decodes exactly HF's own
greedy tokens, through the latent KV pool for MLA; batching, preemption, chunked prefill and compiled
rounds change nothing; the absorbed and expanded MLA forms compute the same attention; the pool's bytes
per token follow each layout's formula; and what cannot run is refused in one line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import ddtree.model.loader as models_module
from ddtree.cli import main
from ddtree.engine import Engine
from ddtree.model.capture import tree_mask
from ddtree.model.forward import TargetForward
from ddtree.model.kv_cache import PagedKVCache
from ddtree.model.loader import load_target, text_backbone
from ddtree.request.params import SamplingParams
from ddtree.speculative.drafter import DFlashDrafter, dflash_config
from ddtree.training.drafter import (
    DrafterConfig,
    build_drafter,
    load_frozen_target,
    loss_weights,
    make_optimizer,
    target_features,
    train_step,
)
from tests.conftest import (
    MOE_KINDS,
    moe_drafter,
    text_config,
    tiny_moe_target,
    tiny_target,
    tiny_tokenizer,
)
from tests.test_engine_greedy import hf_greedy
from tests.test_loaders import refusal
from tests.test_paged import run

TOKENIZER = tiny_tokenizer()
VOCAB = len(TOKENIZER)
PROMPTS = [[1, 5, 9, 22, 3, 7, 7, 2], [30, 2, 2, 14, 8, 19, 25, 11, 4, 0, 6, 13, 40, 41, 99]]
TEXT = "def fibonacci(n):"
NEW = 24
CONTEXT = 256


@pytest.fixture(scope="module", params=MOE_KINDS)
def saved(request, tmp_path_factory):
    """(kind, target dir, drafter dir, {prompt: HF's greedy continuation}), HF's run on HF's own class
    (Kimi: the whole multimodal wrapper, fed text token ids)."""
    root = tmp_path_factory.mktemp(request.param)
    target = tiny_moe_target(request.param, vocab=VOCAB, image_token_id=VOCAB)  # Kimi: no placeholder
    target.save_pretrained(root / "target")
    TOKENIZER.save_pretrained(root / "target")
    moe_drafter(target).save_pretrained(root / "drafter")
    prompts = [*PROMPTS, TOKENIZER.encode(TEXT)]
    expected = {tuple(p): hf_greedy(target, p, NEW) for p in prompts}
    assert all(len(set(e)) > 4 for e in expected.values())  # not one repeated token
    return request.param, root / "target", root / "drafter", expected


def test_every_family_decodes_exactly_hf_greedy_with_every_method(saved):
    kind, target_dir, drafter_dir, expected = saved
    engine = Engine.from_pretrained(target_dir, drafter_dir, max_model_len=CONTEXT, max_num_seqs=3)
    assert engine.runner.cache.layout.is_latent == (kind != "glm4_moe")
    params = SamplingParams(max_new_tokens=NEW)
    for method, budget in (("ar", 1), ("dflash", 1), ("ddtree", 4), ("ddtree", 32)):
        prompts = [list(p) for p in expected]
        results = engine.generate(prompts, params, method=method, budget=budget)  # one batch
        for prompt, result in zip(prompts, results, strict=True):
            assert result.token_ids == expected[tuple(prompt)], (kind, method, budget, prompt)
    text = engine.generate(TEXT, params, method="ddtree")  # a text prompt, through the tokenizer
    assert text.token_ids == expected[tuple(TOKENIZER.encode(TEXT))]


def test_glm4_moe_target_rotates_half_of_each_head():
    """What the exactness above covers for GLM-4: HF's model rotates only the first half of each head."""
    target = tiny_moe_target("glm4_moe")
    cos, _ = target.model.rotary_emb(torch.zeros(1, 3, 64), torch.arange(3)[None])  # [1, 3, rotary dim]
    attn = target.model.layers[0].self_attn
    assert cos.shape[-1] == attn.head_dim // 2 and hasattr(attn, "q_norm") and attn.q_proj.bias is not None


@pytest.fixture(scope="module")
def mla():
    target = tiny_moe_target("deepseek_v3")
    return target, moe_drafter(target)


def specs(n: int, new: int) -> list[tuple[list[int], SamplingParams, str]]:
    """Long greedy and seeded sampled requests over every method."""
    out = []
    for i in range(n):
        prompt = [2 + (7 * i + 5 * j) % 29 for j in range(12 + i)]
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        if i % 3 == 2:
            params = SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=1.0, top_p=0.9, seed=i)
        out.append((prompt, params, ["ddtree", "dflash", "ar"][i % 3]))
    return out


# Seeded samples repeat only with a fixed tree, and scheduling that does not follow the machine's timing.
FIXED = dict(budget=8, prefill_gap_rounds=None)


def test_mla_batch_preemption_and_chunked_prefill_change_no_output(mla):
    """Six greedy and seeded sampled requests on an MLA target: alone, all at once in a pool of about two
    requests' worth (rows preempted and recomputed), and prefilled in 5-token chunks: the same tokens."""
    requests = specs(6, new=60)
    probe = Engine(*mla, max_model_len=CONTEXT, **FIXED)
    solo = [run(probe, [spec])[0] for spec in requests]
    per_request = -(-(20 + 60 + probe.runner.drafter.block_size) // 16)
    budget = 2 * per_request * probe.runner.block_bytes
    tight = Engine(*mla, max_model_len=96, max_num_seqs=6, kv_cache_memory=budget, **FIXED)
    assert run(tight, requests) == solo
    assert tight.num_preemptions > 0
    chunked = Engine(*mla, max_model_len=CONTEXT, max_num_seqs=6, max_num_batched_tokens=5, **FIXED)
    assert run(chunked, requests) == solo


@pytest.mark.parametrize("attention", ["sdpa", pytest.param("flex", marks=pytest.mark.slow)])
def test_compiled_mla_rounds_match_eager(attention):
    """compile=True (fixed shapes: one batch and one node bucket) on a two-layer MLA target (a dense layer
    and an MoE one), SDPA and flex attention (the absorbed form over the latent pool viewed as one KV head):
    the same greedy tokens and seeded samples as the eager engine."""
    target = tiny_moe_target("deepseek_v3", layers=2)
    models = (target, moe_drafter(target))
    requests = specs(3, new=16)
    eager = run(Engine(*models, max_model_len=64, max_num_seqs=2, **FIXED), requests)
    compiled = Engine(
        *models,
        max_model_len=64,
        max_num_seqs=2,
        **FIXED,
        compile=True,
        batch_buckets=[2],
        node_buckets=[9],
        attention=attention,
    )
    assert run(compiled, requests) == eager
    assert bool(compiled.runner.shapes.block_masks) == (attention == "flex")  # the rounds went through flex


def test_absorbed_and_expanded_mla_attention_agree_on_trees(mla):
    """The verify forward's absorbed form (queries through W_UK against the latent, outputs through W_UV)
    and the prefill's expanded keys/values give the same hidden states on random tree rounds: rows with
    scattered blocks, committed lengths up to 40 columns, trees of 9 nodes with random parents."""
    target, _ = mla
    forward = TargetForward(target)
    gen = torch.Generator().manual_seed(0)
    b, n, bs, width = 3, 9, 8, 8
    starts = torch.tensor([0, 17, 40])
    parents = [[-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)] for _ in range(b)]
    anc = torch.zeros(b, n, n, dtype=torch.bool)
    depth = torch.zeros(b, n, dtype=torch.int64)
    for r in range(b):
        for j in range(n):
            k = j
            while k >= 0:
                anc[r, j, k] = True
                k = parents[r][k]
            depth[r, j] = anc[r, j].sum() - 1
    tables = torch.zeros(b, width + 1, dtype=torch.int64)
    tables[:, :width] = (torch.randperm(b * width, generator=gen) + 1).view(b, width)
    positions = starts[:, None] + depth  # [B, N]
    cols = starts[:, None] + torch.arange(n)  # [B, N]
    span = width * bs
    ids = torch.randint(0, 32, (b, n), generator=gen)
    outs = []
    for absorbed in (True, False):
        cache = PagedKVCache(
            len(forward.layers), 1 + b * width, bs, width, forward.layout, torch.float32, "cpu"
        )
        for buf in cache.keys:  # the committed context: the same random latents for both forms
            buf.normal_(generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            hidden, _ = forward(
                ids, positions, cache.at(tables, cols, span), tree_mask(starts, anc, span), None, absorbed
            )
        outs.append(hidden)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["qwen3", *MOE_KINDS])
def test_kv_cache_bytes_per_token_is_the_layouts_formula(kind):
    """MLA: layers x (kv_lora_rank + qk_rope_head_dim) x bytes; GQA: layers x 2 x kv_heads x head_dim x
    bytes. The pool's blocks cost that plus the drafter's own GQA pool, per token."""
    target = tiny_target() if kind == "qwen3" else tiny_moe_target(kind)
    if kind == "kimi_k25":
        target = text_backbone(target)
    config, drafter = text_config(target), moe_drafter(target)
    engine = Engine(target, drafter, max_model_len=64, max_num_seqs=2)
    if hasattr(config, "kv_lora_rank"):
        formula = config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 4
    else:
        formula = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4
    assert engine.runner.kv_cache_bytes_per_token == formula
    d = drafter.config
    draft = d.num_hidden_layers * 2 * d.num_key_value_heads * d.head_dim * 4
    assert engine.runner.block_bytes == 16 * (formula + draft)
    assert engine.runner.kv_cache_bytes == engine.runner.num_blocks * engine.runner.block_bytes


# -- drafter guards ----------------------------------------------------------------------------------------


def guard_warnings(caplog, target, drafter, tokenizer=None) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ddtree.model.loader"):
        models_module.check_pair(target, drafter, tokenizer)
    return [r.getMessage() for r in caplog.records]


def test_drafter_guards_stay_silent_on_a_good_pair(mla, caplog):
    assert guard_warnings(caplog, *mla) == []


def test_a_mask_token_with_a_near_zero_embedding_row_is_named(mla, caplog):
    _, drafter = mla
    target = tiny_moe_target("deepseek_v3")
    with torch.no_grad():
        target.get_input_embeddings().weight[drafter.mask_token_id] = 1e-6
    [message] = guard_warnings(caplog, target, drafter)
    assert "near-zero embedding row" in message and str(drafter.mask_token_id) in message


def test_a_mask_token_that_is_the_eos_or_pad_id_is_named(caplog):
    target = tiny_moe_target("deepseek_v3")
    drafter = moe_drafter(target)
    target.generation_config.eos_token_id = drafter.mask_token_id
    [message] = guard_warnings(caplog, target, drafter)
    assert "EOS token id" in message
    target.generation_config.eos_token_id = None
    target.config.pad_token_id = drafter.mask_token_id
    [message] = guard_warnings(caplog, target, drafter)
    assert "pad token id" in message


def test_a_drafter_vocabulary_other_than_the_targets_is_named_and_stays_lossless(mla, caplog):
    """A padded drafter vocabulary (64 against 32): a warning; drafts use the target's embedding and head,
    so the output is still HF's greedy."""
    target, drafter = mla
    padded = DFlashDrafter(
        dflash_config(target.config, num_layers=1, block_size=8, mask_token_id=31, vocab_size=64)
    )
    padded.load_state_dict(drafter.state_dict())
    [message] = guard_warnings(caplog, target, padded)
    assert "drafter vocabulary 64 differs from the target's 32" in message
    out = Engine(target, padded.eval()).generate(PROMPTS[0][:5], SamplingParams(max_new_tokens=16))
    assert out.token_ids == hf_greedy(target, PROMPTS[0][:5], 16)


# -- loaders and refusals ------------------------------------------------------------------------------------


def test_kimi_k2_configs_load_as_deepseek_v3(mla, tmp_path):
    """Kimi K2's own configs say model_type kimi_k2 (DeepSeek-V3's architecture, unknown to transformers)."""
    target, _ = mla
    target.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "kimi_k2"}))
    loaded, tokenizer = load_target(tmp_path)
    assert type(loaded).__name__ == "DeepseekV3ForCausalLM" and tokenizer is None
    assert hf_greedy(loaded, PROMPTS[0], 12) == hf_greedy(target, PROMPTS[0], 12)


def test_kimi_k25_loads_its_text_backbone_and_refuses_image_placeholders(tmp_path):
    kimi = tiny_moe_target("kimi_k25")
    kimi.save_pretrained(tmp_path)
    target, _ = load_target(tmp_path)
    assert type(target).__name__ == "DeepseekV3ForCausalLM"
    assert not any("vision" in name or "mm_projector" in name for name, _ in target.named_parameters())
    engine = Engine(target, method="ar", max_model_len=64)
    image = kimi.config.image_token_id
    message = refusal(engine.generate, [1, 2, image, 3], SamplingParams(max_new_tokens=4))
    assert "image/video placeholder" in message and str(image) in message


def test_a_model_type_the_installed_transformers_lacks_names_the_release_to_install(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm4_moe"}))
    monkeypatch.delitem(models_module.CONFIG_MAPPING_NAMES, "glm4_moe")
    message = refusal(load_target, tmp_path)
    assert f"transformers>={models_module.TESTED_TRANSFORMERS}" in message


TOKENIZER_CODE = """
from transformers import PreTrainedTokenizerFast


class CodeTokenizer(PreTrainedTokenizerFast):
    pass
"""


def code_tokenizer_dir(directory: Path) -> Path:
    """A saved tokenizer whose tokenizer_config.json names a class in the checkpoint's code (as Kimi's)."""
    TOKENIZER.save_pretrained(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config |= {"auto_map": {"AutoTokenizer": [None, "tokenization_code.CodeTokenizer"]}}
    config["tokenizer_class"] = "CodeTokenizer"
    config_path.write_text(json.dumps(config))
    (directory / "tokenization_code.py").write_text(TOKENIZER_CODE)
    return directory


def test_a_tokenizer_that_ships_as_code_runs_only_with_trust_remote_code(mla, tmp_path):
    target, drafter = mla
    target.save_pretrained(tmp_path)
    code_tokenizer_dir(tmp_path)
    message = refusal(Engine.from_pretrained, tmp_path, method="ar", max_model_len=64)
    assert "--trust-remote-code" in message
    engine = Engine.from_pretrained(tmp_path, method="ar", max_model_len=64, trust_remote_code=True)
    assert type(engine.tokenizer).__name__ == "CodeTokenizer"


def test_the_cli_runs_a_code_tokenizer_only_with_trust_remote_code(tmp_path, capsys):
    target = tiny_moe_target("deepseek_v3", vocab=VOCAB)
    target.save_pretrained(tmp_path)
    code_tokenizer_dir(tmp_path)
    flags = ["generate", TEXT, "--target", str(tmp_path), "--method", "ar", "--max-new-tokens", "3"]
    flags += ["--max-model-len", "64", "--threads", "1"]
    capsys.readouterr()  # saving's progress bars
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "--trust-remote-code" in err[0]
    main([*flags, "--trust-remote-code"])
    assert capsys.readouterr().out.startswith(TEXT)


def test_generate_stats_report_the_latent_pool(tmp_path, capsys):
    """``ddtree generate --stats`` on an MLA target: bytes per token of the latent (3 layers x (32 + 8) x
    4 bytes), the pool in tokens and how many max-model-len requests it holds at once."""
    target = tiny_moe_target("deepseek_v3", vocab=VOCAB)
    target.save_pretrained(tmp_path / "target")
    TOKENIZER.save_pretrained(tmp_path / "target")
    moe_drafter(target).save_pretrained(tmp_path / "drafter")
    flags = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--threads", "1"]
    main(["generate", TEXT, *flags, "--max-new-tokens", "4", "--max-model-len", "64", "--stats"])
    err = capsys.readouterr().err
    stats = json.loads(err[err.index("{") :])
    assert stats["kv_cache_bytes_per_token"] == 3 * (32 + 8) * 4
    assert stats["kv_cache_layout"] == "MLA latent"
    assert stats["kv_cache_tokens"] % 16 == 0 and stats["kv_cache_tokens"] >= 64
    assert stats["max_concurrency"] >= 1


def test_a_drafter_trains_on_an_mla_target(saved):
    """``ddtree train drafter``'s pieces on each family: the loaded target, a drafter ``build_drafter`` shapes
    for it, the truncated feature forward equal to HF's hidden states, and steps that update the drafter."""
    kind, target_dir, _, _ = saved
    target, _ = load_frozen_target(target_dir)
    cfg = DrafterConfig(num_layers=1, block_size=4, anchors=4, lr=3e-3, warmup_steps=1)
    drafter = build_drafter(target, cfg, mask_token_id=VOCAB - 1)
    assert drafter.config.hidden_size == target.config.hidden_size
    ids = torch.randint(0, VOCAB - 1, (2, 20), generator=torch.Generator().manual_seed(0))
    full = target(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(target_features(target, drafter, ids), drafter.select_features(full))
    drafter.train()
    before = [p.detach().clone() for p in drafter.parameters()]
    opt, gen = make_optimizer(drafter, cfg), torch.Generator().manual_seed(0)
    lengths, prompt_lens = torch.tensor([20, 16]), torch.tensor([8, 8])
    loss, _ = train_step(target, drafter, opt, ids, lengths, prompt_lens, cfg, gen, loss_weights(4))
    assert torch.isfinite(torch.tensor(loss)), kind
    assert all(not torch.equal(a, b) for a, b in zip(before, drafter.parameters(), strict=True))
