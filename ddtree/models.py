"""Loading a target, its tokenizer and a DFlash drafter from local directories, and checking they fit."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddtree.drafter import DFlashDrafter
from ddtree.errors import DDTreeError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
ASSETS = Path(__file__).parent / "assets" / "default"
DEFAULT_TARGET = ASSETS / "target"
DEFAULT_DRAFTER = ASSETS / "drafter"


SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")  # what the engine is built and tested on


def check_device(name: str | torch.device) -> torch.device:
    """The torch device ``name`` names, or a one-line DDTreeError when it is unknown, of a kind the engine
    does not run on (mps, meta, ...), or absent from this machine."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise DDTreeError(f"unknown device {str(name)!r}; use cpu, cuda or cuda:N") from None
    if device.type not in SUPPORTED_DEVICE_TYPES:
        raise DDTreeError(f"device {str(name)!r} is not supported; ddtree runs on cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DDTreeError(f"device {str(name)!r} given but CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DDTreeError(f"device {str(name)!r} given but this machine has {count} CUDA device(s)")
    return device


def check_model_dir(directory: str | Path, what: str) -> Path:
    """``directory`` as a Path if it is one; otherwise say so, with a hint when it looks like a Hub id."""
    path = Path(directory)
    if path.is_dir():
        return path
    message = f"{what} directory {directory} does not exist"
    if len(path.parts) == 2 and not str(directory).startswith((".", "/", "~")):
        message += (
            f"; ddtree loads local directories: if {directory} is a Hugging Face Hub id, download it first "
            f"(hf download {directory} --local-dir DIR) and pass DIR"
        )
    raise DDTreeError(message)


def _read_config(directory: Path, what: str) -> dict:
    check_model_dir(directory, what)
    path = directory / "config.json"
    if not path.is_file():
        raise DDTreeError(f"{what} directory {directory} has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DDTreeError(f"{what} config {path} is not valid JSON: {exc.msg}") from None


def load_target(
    directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
):
    """A Qwen3/Llama-family causal LM and its tokenizer (None when the directory has none)."""
    directory = Path(directory)
    config = _read_config(directory, "target")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise DDTreeError(
            f"target {directory} has model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device)
    except (OSError, ValueError) as exc:
        raise DDTreeError(f"cannot load target from {directory}: {str(exc).splitlines()[0]}") from None
    has_tokenizer = any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(directory) if has_tokenizer else None
    return model.eval(), tokenizer


def load_drafter(directory: str | Path) -> DFlashDrafter:
    directory = Path(directory)
    config = _read_config(directory, "drafter")
    if "DFlashDraftModel" not in (config.get("architectures") or []):
        raise DDTreeError(
            f"drafter {directory} is not a DFlash checkpoint (architectures must name DFlashDraftModel)"
        )
    return DFlashDrafter.from_pretrained(directory)


def check_pair(target, drafter: DFlashDrafter) -> None:
    """Refuse a drafter built for another target: it would run, draft garbage and hide the mistake."""
    tc, dc = target.config, drafter.config
    vocab = target.get_input_embeddings().num_embeddings
    if dc.hidden_size != tc.hidden_size:
        raise DDTreeError(
            f"drafter hidden size {dc.hidden_size} does not match the target's {tc.hidden_size}"
        )
    if dc.vocab_size != vocab:
        raise DDTreeError(f"drafter vocabulary {dc.vocab_size} does not match the target's {vocab}")
    if dc.num_target_layers != tc.num_hidden_layers:
        raise DDTreeError(
            f"drafter was trained for a {dc.num_target_layers}-layer target; "
            f"this target has {tc.num_hidden_layers}"
        )
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < tc.num_hidden_layers]
    if bad:
        raise DDTreeError(
            f"drafter target_layer_ids {bad} are outside the target's {tc.num_hidden_layers} layers"
        )
    if drafter.mask_token_id is None or not 0 <= drafter.mask_token_id < vocab:
        raise DDTreeError(
            f"drafter mask_token_id {drafter.mask_token_id!r} is missing or outside the vocabulary"
        )
    if drafter.block_size < 2:
        raise DDTreeError(f"drafter block_size must be >= 2, got {drafter.block_size}")


def eos_token_ids(target, tokenizer=None) -> frozenset[int]:
    """End-of-sequence ids the way HF generate() sees them, plus the tokenizer's own."""
    ids: set[int] = set()
    for source in (getattr(target, "generation_config", None), target.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
            break
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
