"""Train the shipped default target: a small ``Qwen3ForCausalLM``, from scratch, on the stdlib corpus.

A stock transformers architecture means the target loads with ``from_pretrained`` like any hub model,
so nothing in the decoding path is special-cased for it. Training is nanoGPT-style: random packed
windows, AdamW, linear warmup then cosine decay, gradient clipping, fp32 master weights. The final
directory holds the weights (bf16 by default, to fit the repo budget), config and tokenizer together.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

from ddtree.training.checkpoint import CHECKPOINT, SAVE_DTYPES, load_checkpoint, save_checkpoint
from ddtree.training.configs import MAX_LENGTH, TargetConfig
from ddtree.training.data import sample_batch, token_stream
from ddtree.training.evaluate import heldout_ce, unigram_ce
from ddtree.training.loop import autocast, lr_at, make_optimizer, progress, step_bar
from ddtree.training.tokenizer import load_tokenizer

METRICS = "training.json"


RUN_FIELDS = {"steps", "ckpt_every", "eval_every", "save_dtype", "max_minutes"}  # may change when resuming


def build_model(cfg: TargetConfig, tokenizer: PreTrainedTokenizerBase) -> Qwen3ForCausalLM:
    torch.manual_seed(cfg.seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=MAX_LENGTH,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3ForCausalLM(config)


def train_target(
    tokenizer: str | Path,
    out: str | Path,
    cfg: TargetConfig | None = None,
    *,
    work_dir: str | Path = "runs/target",
    resume: bool = False,
    threads: int | None = None,
    root: str | Path | None = None,
) -> dict:
    """Train, save ``out`` (HF model + tokenizer + ``training.json``) and return the metrics.

    Training state (weights, AdamW moments, step) is checkpointed to ``work_dir/checkpoint.pt`` every
    ``ckpt_every`` steps; ``resume=True`` continues from it, with ``cfg.steps`` free to grow.
    """
    cfg = cfg or TargetConfig()
    tok = load_tokenizer(tokenizer)
    work_dir, out = Path(work_dir), Path(out)
    root = None if root is None else Path(root)
    if threads is not None:
        torch.set_num_threads(threads)

    ckpt_path = work_dir / CHECKPOINT
    state = load_checkpoint(ckpt_path, cfg, RUN_FIELDS) if resume else None

    train = token_stream(tok, "train", root)
    heldout = token_stream(tok, "heldout", root)
    model = build_model(cfg, tok)
    opt = make_optimizer(model, cfg)
    start, elapsed = 0, 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start, elapsed = state["step"], state["elapsed"]
    n_params = sum(p.numel() for p in model.parameters())
    tqdm.write(
        f"target: {n_params / 1e6:.2f}M params, {train.numel():,} train tokens, "
        f"{heldout.numel():,} held-out tokens, steps {start}->{cfg.steps}",
        file=sys.stderr,
    )

    tokens_per_step = cfg.batch_size * cfg.seq_len
    bar = step_bar(cfg.steps, start)

    def checkpoint(done: int, seconds: float) -> None:
        save_checkpoint(ckpt_path, cfg, done, seconds, model=model.state_dict(), optimizer=opt.state_dict())

    model.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    step = start
    while step < cfg.steps:
        frac = progress(step, elapsed + time.perf_counter() - t0, cfg)
        if frac >= 1.0:
            break  # out of time: the schedule has already decayed to min_lr
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg, frac, progress_warmup=True)
        x, y = sample_batch(train, cfg.batch_size, cfg.seq_len, cfg.seed, step)  # (B, T) each
        with autocast(cfg.bf16_autocast):
            logits = model(input_ids=x).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        losses.append(loss.item())
        tok_s = (step - start) * tokens_per_step / (time.perf_counter() - t0)
        recent = losses[-20:]
        bar.set_postfix(
            loss=f"{sum(recent) / len(recent):.3f}",
            tok_s=f"{tok_s:.0f}",
            progress=f"{frac:.0%}",
            refresh=False,
        )
        bar.update(1)
        if cfg.eval_every and step % cfg.eval_every == 0:
            ce = heldout_ce(model, heldout, cfg.seq_len)
            tqdm.write(f"step {step}: held-out CE {ce:.4f}", file=sys.stderr)
        if step % cfg.ckpt_every == 0:
            checkpoint(step, elapsed + time.perf_counter() - t0)
    bar.close()
    elapsed += time.perf_counter() - t0
    checkpoint(step, elapsed)

    model = _save_final(model, tok, out, cfg)
    metrics = {
        "params": n_params,
        "steps": step,
        "train_tokens_seen": step * tokens_per_step,
        "corpus_train_tokens": train.numel(),
        "train_seconds_total": round(elapsed, 1),
        "final_train_loss": round(sum(losses[-50:]) / max(1, len(losses[-50:])), 4) if losses else None,
        "heldout_ce": round(heldout_ce(model, heldout, cfg.seq_len), 4),
        "heldout_unigram_ce": round(unigram_ce(train, heldout, len(tok)), 4),
        "heldout_tokens": heldout.numel() - 1,
        "config": asdict(cfg),
    }
    (out / METRICS).write_text(json.dumps(metrics, indent=2) + "\n")
    tqdm.write(
        f"held-out CE {metrics['heldout_ce']} nats/token (unigram {metrics['heldout_unigram_ce']})",
        file=sys.stderr,
    )
    return metrics


def _save_final(
    model: Qwen3ForCausalLM, tok: PreTrainedTokenizerBase, out: Path, cfg: TargetConfig
) -> Qwen3ForCausalLM:
    """Save in ``save_dtype``, then reload in fp32: the returned model is exactly what ships."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(SAVE_DTYPES[cfg.save_dtype]).save_pretrained(out)
    tok.save_pretrained(out)
    return Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32)
