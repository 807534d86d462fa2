"""Drafter training: the causal-feature mask, the loss weights, the data cache and a toy end-to-end run."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
from pathlib import Path

import pytest
import torch

from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.model.loader import load_drafter
from ddtree.request.params import SamplingParams
from ddtree.speculative.dflash2 import DFlash2Drafter
from ddtree.speculative.drafter import DFlashDrafter
from ddtree.training import distill
from ddtree.training.cli import register_drafter
from ddtree.training.distill import ListPrompts, StreamPrompts, build_sequences, generate_continuations
from ddtree.training.drafter import (
    CHECKPOINT,
    DrafterConfig,
    block_inputs,
    build_drafter,
    default_gamma,
    drafter_loss,
    load_frozen_target,
    loss_weights,
    make_optimizer,
    position_loss,
    resolve_mask_token_id,
    sample_anchors,
    selector_loss,
    start_from,
    target_features,
    target_outputs,
    teacher_log_probs,
    train_drafter,
    train_step,
    training_mask,
)
from tests.conftest import MASK, tiny_drafter, tiny_target

TOY = dict(
    num_layers=1,
    block_size=4,
    num_sequences=48,
    prompt_min=4,
    prompt_max=12,
    continuation=24,
    gen_batch_size=8,
    batch_size=4,
    anchors=8,
    steps=60,
    lr=3e-3,
    warmup_steps=4,
    ckpt_every=10,
    bf16_autocast=False,
    mask_token_id=MASK,
    eval_prompts=4,
    eval_prompt_len=12,
    eval_new_tokens=16,
    eval_budget=8,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a busy CI box extra threads only wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("target")
    tiny_target().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [
        json.dumps({"token_ids": [rng.randrange(MASK) for _ in range(rng.randint(4, 12))]}) for _ in range(28)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _hash_dir(path: Path) -> str:
    return hashlib.sha256(b"".join(f.read_bytes() for f in sorted(path.iterdir()))).hexdigest()


@pytest.fixture(scope="module")
def toy_run(target_dir: Path, prompts_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One toy run through the CLI entry point; several tests inspect it."""
    base = tmp_path_factory.mktemp("run")
    target_hash = _hash_dir(target_dir)
    parser = argparse.ArgumentParser()
    register_drafter(parser.add_subparsers(dest="cmd").add_parser("train").add_subparsers(dest="sub"))
    argv = [
        "train",
        "drafter",
        "--target",
        str(target_dir),
        "--out",
        str(base / "out"),
        "--prompts",
        str(prompts_file),
        "--work-dir",
        str(base / "work"),
        "--threads",
        "1",
    ]
    for key, value in TOY.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else ["--no-" + flag[2:]] if value is False else [flag, str(value)]
    args = parser.parse_args(argv)
    args.func(args)
    metrics = json.loads((base / "out" / "training.json").read_text())
    return {"base": base, "metrics": metrics, "target_hash": target_hash}


# -- objective --------------------------------------------------------------------------------------


def test_loss_weights_follow_dflash_gamma() -> None:
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    for size, gamma in ((16, 7.0), (10, 5.0), (8, 4.0)):
        w = loss_weights(size)
        assert w.shape == (size,) and w[0] == 0 and w[1] == 1
        expected = torch.tensor([0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, size)])
        torch.testing.assert_close(w, expected)
    assert 5.0 < default_gamma(12) < 7.0 and torch.all(loss_weights(5, 2.0)[1:].diff() < 0)


def test_mask_tensor_hides_anchor_state_and_other_blocks() -> None:
    anchors = torch.tensor([[1, 5, 9], [3, 3, 12]])  # [B, A]
    s, t = 4, 16
    mask = training_mask(anchors, s, t)
    assert mask.shape == (2, 1, 3 * s, t + 3 * s) and mask.dtype == torch.bool
    for b in range(2):
        for a in range(3):
            rows = mask[b, 0, a * s : (a + 1) * s]  # the block's S queries
            ctx, blk = rows[:, :t], rows[:, t:]
            anchor = int(anchors[b, a])
            assert ctx[:, :anchor].all() and not ctx[:, anchor:].any()  # strictly before the anchor
            own = torch.zeros(3 * s, dtype=torch.bool)
            own[a * s : (a + 1) * s] = True
            assert (blk == own).all()  # bidirectional within the block, blind to the others


def _packed(drafter: DFlashDrafter, target, features, ids, anchors) -> torch.Tensor:
    tokens, positions, _ = block_inputs(ids, anchors, drafter.block_size, MASK)
    b, t = ids.shape
    with torch.no_grad():
        return drafter(
            target.get_input_embeddings()(tokens),
            features,
            positions,
            torch.arange(t)[None].expand(b, t),
            mask=training_mask(anchors, drafter.block_size, t),
        )


def test_block_logits_ignore_features_at_and_after_anchor() -> None:
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=4)
    torch.manual_seed(0)
    t, s = 20, 4
    ids = torch.randint(0, MASK, (1, t))
    features = torch.randn(1, t, len(drafter.target_layer_ids) * target.config.hidden_size)
    anchors = torch.tensor([[7, 12, 3]])
    base = _packed(drafter, target, features, ids, anchors)[0, :s]  # block 0, anchor 7

    later = features.clone()
    later[:, 7:] += 5 * torch.randn_like(later[:, 7:])  # the anchor's own state and everything after
    torch.testing.assert_close(_packed(drafter, target, later, ids, anchors)[0, :s], base)
    other = ids.clone()
    other[0, 12], other[0, 3] = (other[0, 12] + 1) % MASK, (other[0, 3] + 1) % MASK  # other blocks' tokens
    torch.testing.assert_close(_packed(drafter, target, features, other, anchors)[0, :s], base)
    earlier = features.clone()
    earlier[:, 6] += 5 * torch.randn_like(earlier[:, 6])  # the last position before the anchor
    assert not torch.allclose(_packed(drafter, target, earlier, ids, anchors)[0, :s], base, atol=1e-4)


def test_packed_blocks_equal_inference_style_calls() -> None:
    """Each packed block computes exactly what the engine's drafter call computes at that root."""
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=4)
    torch.manual_seed(1)
    t = 18
    ids = torch.randint(0, MASK, (2, t))
    features = torch.randn(2, t, len(drafter.target_layer_ids) * target.config.hidden_size)
    anchors = torch.tensor([[1, 9, 14], [5, 5, 10]])
    packed = _packed(drafter, target, features, ids, anchors).view(2, 3, 4, -1)
    embed = target.get_input_embeddings()
    for b in range(2):
        for a in range(3):
            p = int(anchors[b, a])
            block = torch.tensor([[int(ids[b, p])] + [MASK] * 3])
            with torch.no_grad():
                alone = drafter(
                    embed(block),
                    features[b : b + 1, :p],
                    torch.arange(p, p + 4)[None],
                    torch.arange(p)[None],
                )
            torch.testing.assert_close(packed[b, a], alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_truncated_target_forward_gives_the_engines_features(arch: str) -> None:
    target = tiny_target(arch)
    ids = torch.randint(0, MASK, (2, 12))
    full = target(input_ids=ids, output_hidden_states=True).hidden_states
    for layer_ids in ([1], [0, 2], [1, 3]):  # [1, 3] includes the last layer: the full-forward path
        drafter = tiny_drafter(target, block_size=4)
        drafter.target_layer_ids = layer_ids
        torch.testing.assert_close(target_features(target, drafter, ids), drafter.select_features(full))


def test_anchors_fit_a_whole_block_inside_the_continuation() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths, prompts = torch.tensor([40, 40, 10, 3]), torch.tensor([20, 35, 9, 2])
    anchors, valid = sample_anchors(lengths, prompts, 4, 8, gen)
    assert anchors.shape == valid.shape == (4, 8)
    assert valid[:3].all() and not valid[3].any()  # length 3 cannot hold a 4-token block
    assert ((anchors[0] >= 20) & (anchors[0] <= 36)).all() and anchors[0].unique().numel() == 8
    assert ((anchors[1] >= 35) & (anchors[1] <= 36)).all()  # only two anchors fit: repeats allowed
    assert ((anchors[2] >= 1) & (anchors[2] <= 6)).all()  # continuation too short: whole sequence, >= 1


def test_mask_token_id_comes_from_the_tokenizer_or_a_clear_error() -> None:
    class Tok:
        def get_vocab(self):
            return {"a": 0, "<|mask|>": 5}

    assert resolve_mask_token_id(Tok(), -1, 10) == 5
    assert resolve_mask_token_id(None, 7, 10) == 7
    with pytest.raises(DDTreeError, match="mask-token-id"):
        resolve_mask_token_id(None, -1, 10)
    with pytest.raises(DDTreeError, match="outside"):
        resolve_mask_token_id(Tok(), 12, 10)


# -- data ---------------------------------------------------------------------------------------------


def test_left_padded_generation_matches_unpadded() -> None:
    target = tiny_target()
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    batched = generate_continuations(target, prompts, 10, sample=False, seed=0, pad_id=0)
    for p, cont in zip(prompts, batched, strict=True):
        alone = target.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert cont == alone[0, len(p) :].tolist()
    sampled = generate_continuations(target, prompts, 10, sample=True, seed=3, pad_id=0)
    assert sampled == generate_continuations(target, prompts, 10, sample=True, seed=3, pad_id=0)


def test_stream_prompts_are_windows_of_one_length_per_batch() -> None:
    stream = torch.arange(1000, dtype=torch.int32)
    batch = StreamPrompts(stream, 5, 9).batch(0, 6, torch.Generator().manual_seed(0))
    assert len({len(p) for p in batch}) == 1 and 5 <= len(batch[0]) <= 9
    assert all(p == list(range(p[0], p[0] + len(p))) for p in batch)


def test_data_cache_is_reused_extended_and_refuses_other_settings(tmp_path: Path, monkeypatch) -> None:
    target = tiny_target()
    source = ListPrompts([[1, 2, 3], [4, 5, 6, 7], [8, 9]], max_len=8)
    args = dict(batch_size=2, continuation=6, sample_fraction=0.5, seed=0, pad_id=0)
    path = tmp_path / "data.pt"
    first = build_sequences(target, source, path, {"target": "x"}, 4, **args)
    assert len(first) == 4 and first.sampled.tolist() == [False, False, True, True]
    assert (first.lengths == first.prompt_lens + 6).all()

    calls = []
    real = distill.generate_continuations
    monkeypatch.setattr(distill, "generate_continuations", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = build_sequences(target, source, path, {"target": "x"}, 4, **args)
    assert not calls and torch.equal(again.tokens, first.tokens)  # a rerun skips generation
    more = build_sequences(target, source, path, {"target": "x"}, 6, **args)
    assert len(calls) == 1 and torch.equal(more.tokens[: first.tokens.numel()], first.tokens)
    with pytest.raises(DDTreeError, match="continuation"):
        build_sequences(target, source, path, {"target": "x"}, 4, **{**args, "continuation": 7})
    with pytest.raises(DDTreeError, match="target"):
        build_sequences(target, source, path, {"target": "y"}, 4, **args)


# -- training -----------------------------------------------------------------------------------------


def test_train_step_updates_the_drafter_only(target_dir: Path) -> None:
    target, _ = load_frozen_target(target_dir)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    assert not embed.requires_grad and not head.requires_grad
    assert not any(p.requires_grad for p in target.parameters())
    before = {k: v.clone() for k, v in target.state_dict().items()}
    cfg = DrafterConfig(**TOY)
    drafter = tiny_drafter(target, block_size=4, num_layers=1)
    drafter.train()
    opt = make_optimizer(drafter, cfg)
    drafter_before = [p.detach().clone() for p in drafter.parameters()]
    gen = torch.Generator().manual_seed(0)
    ids, lengths, prompt_lens = torch.randint(0, MASK, (2, 20)), torch.tensor([20, 16]), torch.tensor([8, 8])
    for _ in range(3):
        loss, acc = train_step(target, drafter, opt, ids, lengths, prompt_lens, cfg, gen, loss_weights(4))
        assert math.isfinite(loss) and 1 <= acc <= 4
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    assert embed.grad is None and head.grad is None
    assert all(not torch.equal(a, b) for a, b in zip(drafter_before, drafter.parameters(), strict=True))


def test_toy_run_loss_falls_and_target_is_untouched(toy_run: dict, target_dir: Path) -> None:
    m = toy_run["metrics"]
    losses = [h[1] for h in m["history"]]
    assert m["finished"] and m["steps"] == TOY["steps"] and len(losses) == TOY["steps"]
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10
    assert _hash_dir(target_dir) == toy_run["target_hash"]  # frozen target: its weights are never written
    ev = m["eval"]
    assert ev["dflash"]["matches_ar"] and ev["ddtree"]["matches_ar"]
    assert ev["dflash"]["tau"] >= 1 and ev["ddtree"]["tau"] >= 1


def test_toy_checkpoint_reloads_and_decodes_losslessly(toy_run: dict, target_dir: Path) -> None:
    out = toy_run["base"] / "out"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"]["mask_token_id"] == MASK
    drafter = DFlashDrafter.from_pretrained(out, dtype=torch.float32)
    target, _ = load_frozen_target(target_dir)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(max_new_tokens=24)
    ar = Engine(target, None, method="ar").generate(prompt, params).token_ids
    hf = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert ar == hf[0, len(prompt) :].tolist()
    for method in ("dflash", "ddtree"):
        assert Engine(target, drafter, method=method, budget=8).generate(prompt, params).token_ids == ar


def test_resume_continues_from_the_saved_step(
    toy_run: dict, target_dir: Path, prompts_file: Path, tmp_path: Path
) -> None:
    cfg = DrafterConfig(**TOY)
    common = dict(
        prompts=prompts_file,
        work_dir=tmp_path / "work",
        threads=1,
        data_path=toy_run["base"] / "work" / "data.pt",
    )  # the toy run's cache: no regeneration
    part = train_drafter(target_dir, tmp_path / "out", cfg, until_step=20, **common)
    assert not part["finished"] and part["steps"] == 20 and not (tmp_path / "out").exists()
    assert torch.load(tmp_path / "work" / CHECKPOINT, weights_only=True)["step"] == 20
    done = train_drafter(target_dir, tmp_path / "out", cfg, resume=True, **common)
    assert done["finished"] and done["steps"] == TOY["steps"]
    assert done["history"] == toy_run["metrics"]["history"]  # same batches, same updates as uninterrupted
    resumed = DFlashDrafter.from_pretrained(tmp_path / "out").state_dict()
    straight = DFlashDrafter.from_pretrained(toy_run["base"] / "out").state_dict()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    with pytest.raises(DDTreeError, match="block_size"):
        train_drafter(
            target_dir, tmp_path / "out", DrafterConfig(**{**TOY, "block_size": 8}), resume=True, **common
        )


# -- DFlash2 drafters and distillation of the target's distribution ---------------------------------------


def test_kl_objective_is_the_divergence_from_the_targets_distribution() -> None:
    """Oracle by hand: sum_v p(v) (log p(v) - log q(v)) per position; argmax is the label's cross-entropy."""
    gen = torch.Generator().manual_seed(0)
    logits, teacher_logits = torch.randn(3, 5, 7, generator=gen), torch.randn(3, 5, 7, generator=gen)
    labels = torch.randint(0, 7, (3, 5), generator=gen)
    p, q = teacher_logits.softmax(-1).double(), logits.softmax(-1).double()
    expected = (p * (p.log() - q.log())).sum(-1)
    kl = position_loss(logits, labels, torch.log_softmax(teacher_logits, -1))
    torch.testing.assert_close(kl.double(), expected, rtol=1e-5, atol=1e-6)
    same = position_loss(teacher_logits, labels, torch.log_softmax(teacher_logits, -1))
    assert same.abs().max() < 1e-5  # a drafter that is the target has nothing left to learn
    ce = -q.log().gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(position_loss(logits, labels, None).double(), ce, rtol=1e-5, atol=1e-6)


def test_the_both_objective_adds_the_token_and_distribution_losses(target_dir: Path) -> None:
    """``both`` is the argmax loss plus the kl loss, block and selector terms alike, over the same blocks (a
    DFlash2 drafter: each objective has a selector term)."""
    target, _ = load_frozen_target(target_dir)
    drafter = build_drafter(target, DrafterConfig(**{**TOY, "architecture": "dflash2"}), MASK)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, MASK, (2, 16), generator=gen)
    anchors, valid = sample_anchors(torch.tensor([16, 16]), torch.tensor([4, 4]), 4, 3, gen)
    features, logits = target_outputs(target, drafter, ids)
    parts = (target.get_input_embeddings(), target.get_output_embeddings(), features, ids, anchors, valid)
    common = (*parts, loss_weights(4), MASK)

    def loss(teacher: torch.Tensor | None, tokens_too: bool = False) -> torch.Tensor:
        return drafter_loss(drafter, *common, teacher, 0.7, tokens_too=tokens_too)[0]

    argmax, kl, both = loss(None), loss(logits), loss(logits, tokens_too=True)
    assert argmax > 0 and kl > 0
    torch.testing.assert_close(both, argmax + kl)


def test_teacher_log_probs_come_from_the_position_before_each_label(target_dir: Path) -> None:
    """The target's distribution for block position k is its output at anchor + k - 1, at the temperature."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 12, 5, generator=gen)
    anchors = torch.tensor([[2, 6], [3, 5]])
    positions = anchors[:, :, None] + torch.arange(4)
    valid = torch.tensor([[True, False], [True, True]])
    got = teacher_log_probs(logits, positions, valid, temperature=0.5)  # [3, 3, V]
    rows = [(0, 2), (1, 3), (1, 5)]
    for n, (b, anchor) in enumerate(rows):
        for k in range(1, 4):
            torch.testing.assert_close(got[n, k - 1], torch.log_softmax(logits[b, anchor + k - 1] / 0.5, -1))


@pytest.fixture(scope="module")
def dflash_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target, _ = load_frozen_target(target_dir)
    path = tmp_path_factory.mktemp("dflash")
    tiny_drafter(target, block_size=4, num_layers=1).save_pretrained(path)
    return path


def test_dflash2_started_from_a_dflash_drafter_drafts_its_blocks(target_dir: Path, dflash_dir: Path) -> None:
    """Identity convolutions: the DFlash2 drafter's block hidden states are the DFlash drafter's, bit for bit,
    and it takes that drafter's shape whatever the flags say."""
    target, _ = load_frozen_target(target_dir)
    cfg = DrafterConfig(**{**TOY, "architecture": "dflash2", "num_layers": 3, "block_size": 8})
    drafter, cfg = start_from(dflash_dir, cfg, target)
    base = DFlashDrafter.from_pretrained(dflash_dir)
    assert isinstance(drafter, DFlash2Drafter) and (cfg.num_layers, cfg.block_size) == (1, 4)
    gen = torch.Generator().manual_seed(2)
    embeds, features = (
        torch.randn(2, 4, 64, generator=gen),
        torch.randn(2, 9, 64 * len(base.target_layer_ids), generator=gen),
    )
    block, ctx = torch.arange(9, 13).expand(2, 4), torch.arange(9).expand(2, 9)
    with torch.no_grad():
        assert torch.equal(drafter(embeds, features, block, ctx), base(embeds, features, block, ctx))
    with pytest.raises(DDTreeError, match="DFlash2 drafter: train it with --architecture dflash2"):
        out = dflash_dir.parent / "as-dflash2"
        drafter.save_pretrained(out)
        start_from(out, DrafterConfig(**TOY), target)


def test_selector_scores_the_true_predecessor_as_the_lattice_does(target_dir: Path) -> None:
    """Training's teacher-forced edge (true token l - 1 -> candidates of l) is the lattice's edge from that
    token wherever the true token is one of l - 1's candidates."""
    target, _ = load_frozen_target(target_dir)
    drafter = build_drafter(
        target, DrafterConfig(**{**TOY, "architecture": "dflash2", "selector_top_k": 6}), MASK
    )
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, 4, 64, generator=gen)  # [N, S, H]
    logits = target.get_output_embeddings()(hidden[:, 1:])
    ids, values = drafter.candidates(hidden, target.get_output_embeddings().weight)  # [N, 3, K]
    # labels: the anchor, then each position's candidate number 2 (so every predecessor is a candidate)
    labels = torch.cat((torch.randint(0, MASK, (5, 1), generator=gen), ids[:, :, 2]), dim=1)
    lattice = drafter.edge_scores(hidden, ids, values, labels[:, 0])  # [N, 3, K, K]
    loss, correct = selector_loss(drafter, hidden, logits, labels, None, tokens=True)
    forced = drafter.candidate_selector(hidden[:, 1:], ids, values, labels[:, :-1, None])[:, :, 0]
    torch.testing.assert_close(forced[:, 0], lattice[:, 0, 0])  # after the anchor: every row alike
    torch.testing.assert_close(forced[:, 1:], lattice[:, 1:, 2])  # after candidate 2 of the position before
    expected = -torch.log_softmax(forced, -1)[..., 2]
    torch.testing.assert_close(loss, expected)
    assert torch.equal(correct, forced.argmax(-1) == 2)


@pytest.mark.parametrize("objective", ["kl", "both"])
def test_toy_dflash2_distilled_run_learns_and_decodes_losslessly(
    target_dir: Path, dflash_dir: Path, prompts_file: Path, toy_run: dict, tmp_path: Path, objective: str
) -> None:
    """A DFlash2 drafter distilled from the target's distribution (alone, or with its tokens), started from
    a DFlash drafter: the loss falls, it saves in the public DFlash2 format, loads as one, and decodes
    exactly the target's tokens."""
    run = {"steps": 40, "architecture": "dflash2", "objective": objective, "init_from": str(dflash_dir)}
    cfg = DrafterConfig(**{**TOY, **run})
    data = toy_run["base"] / "work" / "data.pt"
    m = train_drafter(
        target_dir, tmp_path / "out", cfg, prompts=prompts_file, work_dir=tmp_path, data_path=data
    )
    losses = [h[1] for h in m["history"]]
    assert m["finished"] and sum(losses[-10:]) < 0.8 * sum(losses[:10])
    assert m["eval"]["dflash"]["matches_ar"] and m["eval"]["ddtree"]["matches_ar"]
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"] and saved["dflash_config"]["selector_top_k"] == 8
    assert isinstance(load_drafter(tmp_path / "out"), DFlash2Drafter)
