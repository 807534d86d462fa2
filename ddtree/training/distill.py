"""Drafter training data: the target's own continuations of prompts, generated once and cached on disk.

DFlash trains the drafter on what the target *generates*, not on the corpus: at inference the drafter
is scored against the target's choices, so its labels must be the target's choices. Each sequence is a
prompt (a random window of the train-split token stream, or a line of a ``--prompts`` file) followed by
the target's continuation. Half the generation batches are greedy (what greedy decoding will verify) and
half sampled at temperature 1 (what sampled decoding will verify, and more diverse).

Generation is batched through HF ``generate`` (left padding + attention mask for unequal prompts; corpus
batches use one prompt length per batch so they need none). Batch ``b`` is seeded by ``(seed, b)``, so the
cache can be filled in pieces: it is rewritten after every few batches, a killed run resumes where it
stopped, and asking for more sequences later only generates the missing ones.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ddtree.errors import DDTreeError

DATA_VERSION = 1


# -- prompt sources -----------------------------------------------------------------------------------


class StreamPrompts:
    """Random windows of a token stream; every prompt of one batch has the same length (no padding)."""

    def __init__(self, stream: torch.Tensor, min_len: int, max_len: int, name: str = "corpus") -> None:
        if not 1 <= min_len <= max_len:
            raise DDTreeError(f"prompt lengths need 1 <= prompt_min <= prompt_max, got {min_len}, {max_len}")
        if stream.numel() <= max_len:
            raise DDTreeError(f"{name} has {stream.numel()} tokens, too few for {max_len}-token prompts")
        self.stream, self.min_len, self.max_len = stream, min_len, max_len
        digest = hashlib.sha256(stream.to(torch.int32).numpy().tobytes()).hexdigest()[:16]
        self.fingerprint = f"{name}:{digest}:{min_len}-{max_len}"

    def batch(self, index: int, size: int, gen: torch.Generator) -> list[list[int]]:
        length = int(torch.randint(self.min_len, self.max_len + 1, (), generator=gen))
        starts = torch.randint(0, self.stream.numel() - length, (size,), generator=gen)
        idx = starts[:, None] + torch.arange(length)[None, :]  # [size, length]
        return self.stream[idx].tolist()


class ListPrompts:
    """Fixed prompts, used in order and cycled; each is cut to its last ``max_len`` tokens."""

    def __init__(self, prompts: list[list[int]], max_len: int) -> None:
        prompts = [p[-max_len:] for p in prompts if p]
        if not prompts:
            raise DDTreeError("no non-empty prompts to generate training data from")
        self.prompts = prompts
        flat = json.dumps(prompts, separators=(",", ":")).encode()
        self.fingerprint = f"prompts:{hashlib.sha256(flat).hexdigest()[:16]}:{max_len}"

    def batch(self, index: int, size: int, gen: torch.Generator) -> list[list[int]]:
        n = len(self.prompts)
        return [self.prompts[(index * size + i) % n] for i in range(size)]

    def first_pass(self, index: int, size: int) -> bool:
        """Whether batch ``index`` still uses each prompt for the first time (a greedy repeat is a copy)."""
        return (index + 1) * size <= len(self.prompts)


def read_prompts(path: str | Path, tokenizer=None) -> list[list[int]]:
    """Prompts from ``path``: JSON lines (``.jsonl``) or plain text, one prompt per non-empty line.

    A JSON line is a string, a list of token ids, or an object with ``"prompt"``/``"text"`` (text) or
    ``"token_ids"`` (ids). Text needs the target's tokenizer.
    """
    path = Path(path)
    if not path.is_file():
        raise DDTreeError(f"prompts file {path} does not exist")
    items: list[str | list[int]] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            items.append(line)
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DDTreeError(f"{path}:{n}: not valid JSON: {exc.msg}") from None
        if isinstance(item, dict):
            item = item.get("token_ids", item.get("prompt", item.get("text")))
        ok_ids = isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
        if not (isinstance(item, str) or ok_ids):
            raise DDTreeError(
                f"{path}:{n}: expected a string, a list of token ids, or an object with "
                "'prompt', 'text' or 'token_ids'"
            )
        items.append(item)
    out = []
    for item in items:
        if isinstance(item, str):
            if tokenizer is None:
                raise DDTreeError(f"{path} has text prompts but the target has no tokenizer; give token ids")
            item = tokenizer.encode(item, add_special_tokens=False)
        out.append([int(t) for t in item])
    if not out:
        raise DDTreeError(f"prompts file {path} holds no prompts")
    return out


# -- the cached sequences ------------------------------------------------------------------------------


@dataclass
class Sequences:
    """Token sequences packed flat: sequence i is ``tokens[offsets[i]:offsets[i+1]]``, prompt first."""

    tokens: torch.Tensor  # [total] int32
    offsets: torch.Tensor  # [N + 1] int64
    prompt_lens: torch.Tensor  # [N] int64
    sampled: torch.Tensor  # [N] bool: continuation sampled at T=1 (else greedy)

    def __len__(self) -> int:
        return self.prompt_lens.numel()

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]  # [N]

    def batch(
        self, indices: torch.Tensor, pad_id: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ids [B, T], lengths [B], prompt lengths [B]. Causal attention makes the pad inert."""
        lengths = self.lengths[indices]
        ids = torch.full((indices.numel(), int(lengths.max())), pad_id, dtype=torch.long)
        for row, i in enumerate(indices.tolist()):
            seq = self.tokens[self.offsets[i] : self.offsets[i + 1]]
            ids[row, : seq.numel()] = seq
        return ids, lengths, self.prompt_lens[indices]

    @staticmethod
    def from_lists(seqs: list[list[int]], prompt_lens: list[int], sampled: list[bool]) -> Sequences:
        lengths = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.long)
        flat = [t for s in seqs for t in s]
        return Sequences(
            torch.tensor(flat, dtype=torch.int32),
            lengths.cumsum(0),
            torch.tensor(prompt_lens, dtype=torch.long),
            torch.tensor(sampled, dtype=torch.bool),
        )


def weights_fingerprint(directory: str | Path) -> str:
    """sha256 over the target's weight files: a retrained target invalidates cached continuations."""
    h = hashlib.sha256()
    files = sorted(Path(directory).glob("*.safetensors")) + sorted(Path(directory).glob("*.bin"))
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def is_sampled_batch(index: int, fraction: float) -> bool:
    """Spread sampled batches evenly: batch b is sampled iff floor((b+1)f) > floor(bf)."""
    return int((index + 1) * fraction) > int(index * fraction)


@torch.no_grad()
def generate_continuations(
    target,
    prompts: list[list[int]],
    new_tokens: int,
    sample: bool,
    seed: int,
    pad_id: int,
    eos_ids: frozenset[int] = frozenset(),
) -> list[list[int]]:
    """The target's continuations (greedy, or pure T=1 sampling), each cut after its first EOS."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
        ids[row, width - len(p) :] = torch.tensor(p)
        attn[row, width - len(p) :] = 1
    device = next(target.parameters()).device
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = target.generate(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            max_new_tokens=new_tokens,
            pad_token_id=pad_id,
            eos_token_id=sorted(eos_ids) or None,
            **kwargs,
        )[:, width:].tolist()  # [B, <= new_tokens]
    conts = []
    for row in out:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        conts.append(row[:cut])
    return conts


def build_sequences(
    target,
    source: StreamPrompts | ListPrompts,
    cache_path: str | Path,
    meta: dict,
    num_sequences: int,
    batch_size: int,
    continuation: int,
    sample_fraction: float,
    seed: int,
    pad_id: int,
    eos_ids: frozenset[int] = frozenset(),
    save_every: int = 8,
) -> Sequences:
    """Load the cache at ``cache_path`` and generate whatever it still lacks, saving as it goes.

    ``meta`` (e.g. the target's weights fingerprint) plus the prompt source and generation settings
    identify the data: a cache made with other settings is refused rather than mixed with new sequences.
    """
    cache_path = Path(cache_path)
    meta = {
        "version": DATA_VERSION,
        **meta,
        "source": source.fingerprint,
        "batch_size": batch_size,
        "continuation": continuation,
        "sample_fraction": sample_fraction,
        "seed": seed,
    }
    seqs: list[list[int]] = []
    plens: list[int] = []
    sampled: list[bool] = []
    if cache_path.is_file():
        saved = torch.load(cache_path, weights_only=True)
        if saved.get("meta") != meta:
            diff = sorted(
                k
                for k in set(meta) | set(saved.get("meta", {}))
                if saved.get("meta", {}).get(k) != meta.get(k)
            )
            raise DDTreeError(
                f"data cache {cache_path} was made with other settings ({', '.join(diff)}); "
                "delete it or choose another --data path"
            )
        have = Sequences(saved["tokens"], saved["offsets"], saved["prompt_lens"], saved["sampled"])
        for i in range(len(have)):
            seqs.append(have.tokens[have.offsets[i] : have.offsets[i + 1]].tolist())
        plens, sampled = have.prompt_lens.tolist(), have.sampled.tolist()
    num_batches = -(-num_sequences // batch_size)
    done = len(seqs) // batch_size  # the cache always holds whole batches
    del seqs[done * batch_size :], plens[done * batch_size :], sampled[done * batch_size :]
    if done < num_batches:
        model_was_training = target.training
        target.eval()
        bar = tqdm(
            total=num_batches,
            initial=done,
            unit="batch",
            desc="generating data",
            dynamic_ncols=True,
            mininterval=1.0 if sys.stderr.isatty() else 30.0,
        )
        for b in range(done, num_batches):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + b)
            prompts = source.batch(b, batch_size, gen)
            sample = is_sampled_batch(b, sample_fraction)
            if isinstance(source, ListPrompts) and not source.first_pass(b, batch_size):
                sample = True  # greedy would repeat an earlier greedy sequence exactly
            conts = generate_continuations(
                target, prompts, continuation, sample, seed * 1_000_003 + b, pad_id, eos_ids
            )
            for p, c in zip(prompts, conts, strict=True):
                seqs.append(p + c)
                plens.append(len(p))
                sampled.append(sample)
            bar.update(1)
            if (b + 1) % save_every == 0 or b + 1 == num_batches:
                _save(cache_path, meta, Sequences.from_lists(seqs, plens, sampled))
        bar.close()
        target.train(model_was_training)
    data = Sequences.from_lists(seqs[:num_sequences], plens[:num_sequences], sampled[:num_sequences])
    return data


def _save(path: Path, meta: dict, data: Sequences) -> None:
    """Write-then-rename, so a run killed mid-save keeps the previous cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "meta": meta,
            "tokens": data.tokens,
            "offsets": data.offsets,
            "prompt_lens": data.prompt_lens,
            "sampled": data.sampled,
        },
        tmp,
    )
    tmp.replace(path)
