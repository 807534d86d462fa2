"""Corpus split, tokenizer round trip and a toy target run: what the shipped default model is built from."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddtree.errors import DDTreeError
from ddtree.training.corpus import corpus_files, is_heldout, read_text, stdlib_root
from ddtree.training.target import CHECKPOINT, TargetConfig, train_target
from ddtree.training.tokenizer import EOS, MASK, train_tokenizer

EXCLUDED = [
    "test/test_os.py",
    "pkg/tests/helper.py",
    "pkg/test_thing.py",
    "idlelib/editor.py",
    "site-packages/third_party.py",
    "pkg/__pycache__/mod.py",
    "pydoc_data/topics.py",
    "_sysconfigdata__linux_x86_64-linux-gnu.py",
    "config-3.11-x86_64-linux-gnu/python-config.py",
    "encodings/cp1252.py",
]
HELDOUT = [f"m{i}.py" for i in (85, 93, 136)]  # names whose path hash falls in the held-out 2%
SOURCES = ["textwrap.py", "heapq.py", "bisect.py", "colorsys.py", "fnmatch.py", "string.py", "keyword.py"]
TRICKY = "def f(x):\n\tif x:\r\n        return 'é ✓ 😀'  \n\n\n    # trailing   \n"

TINY = dict(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    intermediate_size=64,
    seq_len=32,
    batch_size=4,
    lr=1e-2,
    warmup_steps=2,
    ckpt_every=2,
    save_dtype="bfloat16",
)


@pytest.fixture(scope="module")
def fake_stdlib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small stdlib-shaped tree: real modules to train on, plus one file for every exclusion rule."""
    root = tmp_path_factory.mktemp("stdlib")
    real = stdlib_root()
    files = {name: read_text(real / name) for name in SOURCES}
    files |= {name: read_text(real / src) for name, src in zip(HELDOUT, SOURCES, strict=False)}
    files |= {name: "x = 1\n" for name in EXCLUDED}
    files["encodings/cp1252.py"] = '""" Python Character Mapping Codec generated from gencodec.py."""\n'
    files["encodings/utf_8.py"] = "import codecs\n"
    files["pkg/__init__.py"] = TRICKY
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8", newline="")
    (root / "README.txt").write_text("not python\n")
    return root


@pytest.fixture(scope="module")
def tiny_tokenizer(fake_stdlib: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300, root=fake_stdlib)


def _rel(files: list[Path], root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in files]


def test_fake_corpus_split_and_exclusions(fake_stdlib: Path) -> None:
    train, heldout = (
        _rel(corpus_files("train", fake_stdlib), fake_stdlib),
        _rel(corpus_files("heldout", fake_stdlib), fake_stdlib),
    )
    assert heldout == sorted(HELDOUT)
    assert train == sorted(SOURCES + ["encodings/utf_8.py", "pkg/__init__.py"])
    assert not set(EXCLUDED) & set(train + heldout)


def test_real_stdlib_split_is_deterministic_and_disjoint() -> None:
    root = stdlib_root()
    train, heldout = _rel(corpus_files("train"), root), _rel(corpus_files("heldout"), root)
    assert train == _rel(corpus_files("train"), root) and train == sorted(train)
    assert heldout and not set(train) & set(heldout)
    assert 0.01 < len(heldout) / (len(train) + len(heldout)) < 0.06
    assert all(is_heldout(r) for r in heldout) and not any(is_heldout(r) for r in train)
    for rel in train + heldout:
        parts = rel.split("/")
        assert not {"test", "tests", "idlelib", "site-packages", "__pycache__"} & set(parts[:-1]), rel
        assert not parts[-1].startswith("test_") and rel.endswith(".py"), rel


def test_bad_split_and_root_raise(tmp_path: Path) -> None:
    with pytest.raises(DDTreeError):
        corpus_files("validation")  # type: ignore[arg-type]
    with pytest.raises(DDTreeError):
        corpus_files("train", tmp_path / "missing")
    with pytest.raises(DDTreeError):
        train_tokenizer(tmp_path / "tok", vocab_size=300, root=tmp_path)  # no .py files


def test_tokenizer_round_trips_and_has_special_tokens(tiny_tokenizer: Path, fake_stdlib: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    assert len(tok) == 300
    assert tok.eos_token == tok.pad_token == tok.bos_token == EOS and tok.mask_token == MASK
    assert tok.convert_tokens_to_ids([EOS, MASK]) == [0, 1]
    heldout = [read_text(p) for p in corpus_files("heldout", fake_stdlib)]
    for text in [TRICKY, "", " leading", "\n\n\t\t  x\n", *heldout]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.encode(EOS + "x", add_special_tokens=False)[0] == tok.eos_token_id


def test_toy_target_trains_saves_and_resumes(tiny_tokenizer: Path, fake_stdlib: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    out, work = tmp_path / "model", tmp_path / "work"
    cfg = TargetConfig(**TINY, steps=60)
    metrics = train_target(tiny_tokenizer, out, cfg, work_dir=work, root=fake_stdlib)
    assert metrics["steps"] == 60 and metrics["final_train_loss"] < math.log(300) - 1.0
    assert metrics["heldout_ce"] < metrics["heldout_unigram_ce"]
    assert json.loads((out / "training.json").read_text())["steps"] == 60

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and model.config.tie_word_embeddings
    c = model.config
    assert (c.eos_token_id, c.bos_token_id, c.pad_token_id, c.max_position_embeddings) == (0, 0, 0, 2048)
    tok = AutoTokenizer.from_pretrained(out)  # tokenizer files live next to the weights
    ids = torch.tensor([tok.encode("def f(x):\n    return x\n")])
    assert torch.isfinite(model.float()(input_ids=ids).logits).all()

    # Resuming at the saved step does no work; asking for more steps continues from it.
    same = train_target(tiny_tokenizer, tmp_path / "same", cfg, work_dir=work, resume=True, root=fake_stdlib)
    assert same["heldout_ce"] == metrics["heldout_ce"]
    more = train_target(
        tiny_tokenizer,
        tmp_path / "more",
        TargetConfig(**TINY, steps=64),
        work_dir=work,
        resume=True,
        root=fake_stdlib,
    )
    assert more["steps"] == 64 and torch.load(work / CHECKPOINT, weights_only=True)["step"] == 64

    with pytest.raises(DDTreeError):
        train_target(
            tiny_tokenizer,
            tmp_path / "x",
            TargetConfig(**(TINY | {"hidden_size": 64})),
            work_dir=work,
            resume=True,
            root=fake_stdlib,
        )
    with pytest.raises(DDTreeError):
        train_target(tiny_tokenizer, tmp_path / "x", cfg, work_dir=tmp_path / "none", resume=True)
    with pytest.raises(DDTreeError):
        train_target(tmp_path / "no-tokenizer", tmp_path / "x", cfg)
    with pytest.raises(DDTreeError):
        TargetConfig(num_heads=3, num_kv_heads=2)


def test_cli_builds_target_config_from_flags() -> None:
    import argparse

    from ddtree.training.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        [
            "train",
            "target",
            "--tokenizer",
            "t",
            "--out",
            "o",
            "--hidden-size",
            "32",
            "--no-bf16-autocast",
            "--lr",
            "1e-3",
            "--resume",
        ]
    )
    assert (args.hidden_size, args.bf16_autocast, args.lr, args.resume) == (32, False, 1e-3, True)
    args = parser.parse_args(["train", "tokenizer", "--out", "o", "--vocab-size", "512"])
    assert args.vocab_size == 512 and args.func.__name__ == "_run_tokenizer"
