"""The benchmark loop: every configuration on every prompt, interleaved, seeded, after a warm-up.

Why interleaved: on a shared machine the speed drifts (thermal state, other jobs, a training run niced
in the background). Running all configurations of one prompt back to back, and rotating their order
each repeat, spreads that drift over all of them instead of charging it to whichever ran last. The seed
depends only on (prompt, repeat), so every method sees the same seed, and sampled runs repeat exactly.

With ``--compile`` every engine configuration also runs on a second engine built with ``compile=True``
from the same weights (``Spec.compiled``; label suffix ``+compiled``), right after its eager twin.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

from tqdm import tqdm

from ddtree.bench.hf import hf_generate
from ddtree.bench.machine import peak_memory_bytes, reset_peak_memory
from ddtree.bench.prompts import Prompt
from ddtree.errors import DDTreeError
from ddtree.request.params import METHODS, SamplingParams, check_speculative_options

ENGINE_METHODS = METHODS
HF_METHODS = ("hf", "hf-pld")
ALL_METHODS = ENGINE_METHODS + HF_METHODS
COMPILED_SUFFIX = "+compiled"


@dataclass(frozen=True)
class Spec:
    """One configuration: a method, for ``ddtree`` a budget, and which engine runs it (eager or compiled)."""

    method: str
    budget: int = 0
    compiled: bool = False

    @property
    def base_label(self) -> str:
        """The label of the configuration, whichever engine runs it."""
        return f"ddtree@{self.budget}" if self.method == "ddtree" else self.method

    @property
    def label(self) -> str:
        return self.base_label + (COMPILED_SUFFIX if self.compiled else "")


def pick_engine(engines, spec: Spec):
    """The engine of ``spec``: ``engines`` is one engine, or {False: eager, True: compiled}."""
    return engines[spec.compiled] if isinstance(engines, dict) else engines


@dataclass(frozen=True)
class BenchConfig:
    methods: tuple[str, ...]
    budgets: tuple[int, ...]
    temperatures: tuple[float, ...]
    max_new_tokens: int
    repeats: int = 3
    topk: int | None = None
    seed: int = 0
    warmup: int = 1
    pld_tokens: int = 10
    compile: bool = False  # also run every engine configuration on the compiled engine
    top_p: float = 1.0  # of the sampled runs (T > 0)

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in ALL_METHODS]
        if bad:
            raise DDTreeError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(ALL_METHODS)}")
        if "ar" not in self.methods:
            raise DDTreeError("--methods must include 'ar': it is the speedup and T=0 reference")
        if len(set(self.methods)) != len(self.methods):
            raise DDTreeError("--methods lists a method twice")
        if "ddtree" in self.methods and not self.budgets:
            raise DDTreeError("method 'ddtree' needs at least one budget")
        for budget in self.budgets:
            check_speculative_options("ddtree", budget, self.topk)
        if len(set(self.budgets)) != len(self.budgets):
            raise DDTreeError("--budgets lists a budget twice")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise DDTreeError("--temperatures must be numbers >= 0")
        if len(set(self.temperatures)) != len(self.temperatures):
            raise DDTreeError("--temperatures lists a temperature twice")
        for name in ("max_new_tokens", "repeats", "pld_tokens"):
            if getattr(self, name) < 1:
                raise DDTreeError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise DDTreeError(f"--warmup must be >= 0, got {self.warmup}")
        if not 0.0 < self.top_p <= 1.0:
            raise DDTreeError(f"--top-p must be in (0, 1], got {self.top_p}")

    def sampling(self, temperature: float, seed: int) -> SamplingParams:
        """One response's parameters: greedy at T = 0, else T and the configured top-p."""
        top_p = self.top_p if temperature > 0 else 1.0
        return SamplingParams(
            temperature=temperature, top_p=top_p, seed=seed, max_new_tokens=self.max_new_tokens
        )

    @property
    def specs(self) -> list[Spec]:
        """Every configuration; with ``compile``, each engine one followed by its compiled twin."""
        out = []
        for m in self.methods:
            for spec in [Spec(m, b) for b in self.budgets] if m == "ddtree" else [Spec(m)]:
                out.append(spec)
                if self.compile and m in ENGINE_METHODS:
                    out.append(Spec(spec.method, spec.budget, compiled=True))
        return out

    @property
    def needs_drafter(self) -> bool:
        return any(m in ("dflash", "ddtree") for m in self.methods)


def seed_for(base: int, prompt_index: int, repeat: int) -> int:
    """Same for every method; differs per prompt and repeat (the warm-up is repeat -1)."""
    return base + 100_003 * (repeat + 1) + prompt_index


def encode_prompts(engine, prompts: list[Prompt], max_new_tokens: int) -> list[list[int]]:
    """Token ids of every prompt, checked against the context before the first timed run."""
    out = []
    for p in prompts:
        ids = engine.encode(p.text if p.text is not None else list(p.token_ids))
        if len(ids) + max_new_tokens > engine.max_model_len:
            raise DDTreeError(
                f"prompt {p.id} ({len(ids)} tokens) plus --max-new-tokens {max_new_tokens} exceeds the "
                f"target's context of {engine.max_model_len} tokens"
            )
        out.append(ids)
    return out


def run_one(engines, spec: Spec, prompt_ids: list[int], params: SamplingParams, cfg: BenchConfig) -> dict:
    """One response of one configuration (on ``pick_engine(engines, spec)``): its tokens and what it cost.

    The garbage collector runs between responses, never inside one: a collection pause would be charged
    to whichever method happened to trigger it. (``run_bench`` freezes the models' objects, so these
    collections only walk what the previous response left behind.)
    """
    engine = pick_engine(engines, spec)
    engine.reset_prefix_cache()  # every configuration prefills the prompt cold, whatever ran it before
    gc.collect()
    reset_peak_memory(engine.runner.device)
    gc.disable()
    try:
        if spec.method in HF_METHODS:
            pld = cfg.pld_tokens if spec.method == "hf-pld" else None
            record = hf_generate(engine.target, prompt_ids, params, engine.eos_token_ids, pld)
        else:
            record = _engine_generate(engine, spec, prompt_ids, params, cfg.topk)
    finally:
        gc.enable()
    record["peak_memory_bytes"] = peak_memory_bytes(engine.runner.device)
    return record


def _engine_generate(engine, spec: Spec, prompt_ids: list[int], params: SamplingParams, topk) -> dict:
    """``Engine.stream`` rather than ``generate`` (which wraps it): the stats after the first round give
    the drafter's first pass, which TPOT counts as prefill."""
    token_ids: list[int] = []
    first_draft = 0.0
    delta = None
    budget = spec.budget if spec.method == "ddtree" else None
    deltas = engine.stream(prompt_ids, params, method=spec.method, budget=budget, topk=topk)
    for k, delta in enumerate(deltas):
        token_ids += delta.token_ids
        if k == 1:  # delta 0 is the prefill, delta 1 the first round
            first_draft = delta.stats.stage_seconds["draft"]
    stats = delta.stats
    return {
        "token_ids": token_ids,
        "finish_reason": delta.finish_reason,
        "prompt_tokens": stats.prompt_tokens,
        "acceptance_lengths": list(stats.acceptance_lengths),
        "stage_seconds": dict(stats.stage_seconds),
        "prefill_seconds": stats.prefill_seconds,
        "decode_seconds": stats.decode_seconds,
        "first_draft_seconds": first_draft,
        "decode_tokens": stats.decode_tokens,
    }


def run_bench(
    engines, prompts: list[Prompt], prompt_ids: list[list[int]], cfg: BenchConfig, progress: bool = True
) -> list[dict]:
    """All timed records. Order: repeat > prompt > temperature > configurations (rotated per repeat).
    ``engines``: one engine, or {False: eager, True: compiled} when ``cfg.compile``."""
    specs = cfg.specs
    warm = min(cfg.warmup, len(prompts))
    total = (cfg.repeats * len(prompts) + warm) * len(cfg.temperatures) * len(specs)
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress, dynamic_ncols=True)

    def run(spec: Spec, i: int, temperature: float, repeat: int) -> dict:
        bar.set_postfix_str(f"{spec.label} T={temperature:g} prompt {i}", refresh=False)
        params = cfg.sampling(temperature, seed_for(cfg.seed, i, repeat))
        record = run_one(engines, spec, prompt_ids[i], params, cfg)
        bar.update()
        return record

    gc.collect()
    gc.freeze()  # the models, tokenizer and libraries: nothing to collect there, and a lot to walk
    try:
        for i in range(warm):  # first calls pay for allocations, kernel selection, lazy imports
            for temperature in cfg.temperatures:
                for spec in specs:
                    run(spec, i, temperature, repeat=-1)
        records = []
        for repeat in range(cfg.repeats):
            shift = repeat % len(specs)
            order = specs[shift:] + specs[:shift]
            for i, prompt in enumerate(prompts):
                for temperature in cfg.temperatures:
                    for spec in order:
                        record = run(spec, i, temperature, repeat)
                        records.append(
                            {
                                "label": spec.label,
                                "method": spec.method,
                                "budget": spec.budget,
                                "compiled": spec.compiled,
                                "temperature": temperature,
                                "prompt_index": i,
                                "prompt_id": prompt.id,
                                "repeat": repeat,
                                "seed": seed_for(cfg.seed, i, repeat),
                                **record,
                            }
                        )
    finally:
        gc.unfreeze()
        bar.close()
    return records
