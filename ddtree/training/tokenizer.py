"""Byte-level BPE for Python source: every byte string encodes, and decoding gives back the exact text.

Byte-level (not unicode-level) BPE never meets an unknown character, and with no normalizer, no
prefix space and ``clean_up_tokenization_spaces=False`` the round trip keeps indentation and blank
lines byte for byte, which speculative decoding's lossless check is measured against.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ddtree.errors import DDTreeError
from ddtree.training.configs import MAX_LENGTH
from ddtree.training.corpus import corpus_files, corpus_texts

EOS = "<|endoftext|>"  # separates documents; also bos and pad
MASK = "<|mask|>"  # the DFlash drafter's placeholder for not-yet-drafted positions


def train_tokenizer(out: str | Path, vocab_size: int = 4096, root: str | Path | None = None) -> Path:
    """Train on the train split of the corpus under ``root`` (default: this interpreter's stdlib)."""
    if vocab_size < 258:
        raise DDTreeError(f"vocab_size must be >= 258 (256 bytes + 2 special tokens), got {vocab_size}")
    root = None if root is None else Path(root)
    files = corpus_files("train", root)
    if not files:
        raise DDTreeError(f"no corpus files found under {root}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, MASK],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts("train", root), trainer=trainer, length=len(files))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        mask_token=MASK,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_LENGTH,
    )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer directory saved by :func:`train_tokenizer` (or a model directory holding one)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise DDTreeError(f"{path} is not a tokenizer directory (no tokenizer.json)")
    return AutoTokenizer.from_pretrained(path)
