"""Token streams and batches: documents joined by ``<|endoftext|>`` and cut into fixed-length windows.

Each document is preceded by ``<|endoftext|>``, so a prompt that starts a fresh file looks like the
training data. Batches are random windows drawn with a generator seeded by ``(seed, step)``: a resumed
run sees exactly the batches an uninterrupted one would, without saving any RNG state.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from ddtree.errors import DDTreeError
from ddtree.training.corpus import Split, corpus_texts


def token_stream(tokenizer: PreTrainedTokenizerBase, split: Split, root: Path | None = None) -> torch.Tensor:
    """All documents of a split as one 1-D int32 tensor: ``[eos] doc0 [eos] doc1 ...``."""
    eos = tokenizer.eos_token_id
    backend = tokenizer.backend_tokenizer  # the raw Rust tokenizer: no length warnings, batched
    texts = list(corpus_texts(split, root))
    if not texts:
        raise DDTreeError(f"the {split} split of the corpus is empty")
    ids: list[int] = []
    for enc in backend.encode_batch(texts, add_special_tokens=False):
        ids.append(eos)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int32)


def sample_batch(
    stream: torch.Tensor, batch_size: int, seq_len: int, seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, both (batch_size, seq_len) int64, from random offsets."""
    if stream.numel() <= seq_len + 1:
        raise DDTreeError(f"corpus has {stream.numel()} tokens, fewer than seq_len + 2 = {seq_len + 2}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]  # (B, T+1)
    window = stream[idx].long()
    return window[:, :-1], window[:, 1:]


def eval_windows(stream: torch.Tensor, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive non-overlapping windows covering every token of ``stream`` once as a target."""
    out = []
    for start in range(0, stream.numel() - 1, seq_len):
        window = stream[start : start + seq_len + 1].long()
        out.append((window[:-1], window[1:]))
    return out
