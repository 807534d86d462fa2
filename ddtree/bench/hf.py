"""Hugging Face ``generate()`` baselines, timed the way the engine times itself.

``hf`` is plain greedy / sampled ``generate()``; ``hf-pld`` is its prompt lookup decoding
(``prompt_lookup_num_tokens``), the drafter-free speculative baseline. Both run on the very same target
module as the engine.

Timing: a streamer timestamps every ``put()``. ``generate()`` puts the prompt first, then the token(s)
of every target forward. The first put after the prompt closes the prefill (for prompt lookup, the first
forward already verifies candidates, so it may carry several tokens); everything after it up to
``streamer.end()`` is decode time, and the tokens it carries are the decode tokens. This is the engine's
own split (its prefill emits the first token) without running every prompt twice to subtract a separately
measured prefill, which would mix two runs' noise into each number. ``put`` receives tokens already
copied to the host, so on CUDA the timestamps follow the device.
"""

from __future__ import annotations

import time

import torch
from transformers.generation.streamers import BaseStreamer

from ddtree.request.params import SamplingParams


class _Clock(BaseStreamer):
    """Records (time, number of tokens) for each put and the time of end()."""

    def __init__(self) -> None:
        self.puts: list[tuple[float, int]] = []
        self.end_time: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        self.end_time = time.perf_counter()


def cut_after_eos(token_ids: list[int], eos_ids: frozenset[int]) -> list[int]:
    """HF may keep tokens past an EOS accepted mid-block; the engine stops at it. Compare like with like."""
    for i, t in enumerate(token_ids):
        if t in eos_ids:
            return token_ids[: i + 1]
    return token_ids


@torch.inference_mode()
def hf_generate(
    target, prompt_ids: list[int], params: SamplingParams, eos_ids: frozenset[int], pld_tokens: int | None
) -> dict:
    """One response of HF ``generate()``; returns the record fields the engine runs also fill."""
    device = next(target.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    eos = sorted(eos_ids) or None
    sampling = {"do_sample": False}
    if not params.greedy:  # the engine's target distribution: softmax(logits / T) under top-p, nothing else
        sampling = {"do_sample": True, "temperature": params.temperature, "top_k": 0, "top_p": params.top_p}
    if pld_tokens:
        sampling["prompt_lookup_num_tokens"] = pld_tokens
    if params.seed is not None:
        torch.manual_seed(params.seed)  # HF samples from the global generator
    clock = _Clock()
    start = time.perf_counter()
    out = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=params.max_new_tokens,
        eos_token_id=eos,
        pad_token_id=eos[0] if eos else 0,
        repetition_penalty=1.0,
        streamer=clock,
        **sampling,
    )
    end = clock.end_time or time.perf_counter()
    token_ids = cut_after_eos(out[0, len(prompt_ids) :].tolist(), eos_ids)
    puts = clock.puts[1:]  # [0] is the prompt
    first_time, first_tokens = puts[0] if puts else (end, len(token_ids))
    decode_tokens = max(0, len(token_ids) - first_tokens)
    finish = "stop" if token_ids and token_ids[-1] in eos_ids else "length"
    return {
        "token_ids": token_ids,
        "finish_reason": finish,
        "prompt_tokens": len(prompt_ids),
        "acceptance_lengths": [n for _, n in puts[1:]],
        "stage_seconds": None,
        "prefill_seconds": first_time - start,
        "decode_seconds": end - first_time if decode_tokens else 0.0,
        "first_draft_seconds": 0.0,
        "decode_tokens": decode_tokens,
    }
