"""Held-out cross-entropy of a causal LM, next to the unigram baseline on the very same target tokens.

The unigram model (train-split token frequencies, add-one smoothed) is what a model that ignores all
context would score; a trained LM that is not far below it has learned nothing worth drafting for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from ddtree.training.data import eval_windows


@torch.no_grad()
def heldout_ce(model: PreTrainedModel, stream: torch.Tensor, seq_len: int, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy in nats/token over every target of ``stream``."""
    was_training = model.training
    model.eval()
    windows = eval_windows(stream, seq_len)
    full = [w for w in windows if w[0].numel() == seq_len]
    batches = [_stack(full[i : i + batch_size]) for i in range(0, len(full), batch_size)]
    batches += [_stack([w]) for w in windows if w[0].numel() != seq_len]  # the short tail window
    total, count = 0.0, 0
    for x, y in batches:  # (B, T) each
        logits = model(input_ids=x).logits.float()  # (B, T, V)
        total += F.cross_entropy(logits.flatten(0, 1), y.reshape(-1), reduction="sum").item()
        count += y.numel()
    model.train(was_training)
    return total / count


def _stack(chunk: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([x for x, _ in chunk]), torch.stack([y for _, y in chunk])


def unigram_ce(train_stream: torch.Tensor, heldout_stream: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of add-one-smoothed train unigram counts on the held-out targets."""
    counts = torch.bincount(train_stream.long(), minlength=vocab_size).double() + 1.0  # (V,)
    logp = counts.log() - counts.sum().log()
    targets = heldout_stream[1:].long()  # the tokens heldout_ce predicts
    return -logp[targets].mean().item()
