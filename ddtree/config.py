"""Every engine option in one place (vLLM's ``EngineArgs`` idea): its default, its check, its error message
and the command-line flag that sets it.

``Engine(...)``, ``Engine.from_pretrained(...)``, ``ddtree generate``, ``serve`` and ``bench`` all build an
``EngineConfig``; the commands' flags are generated from its fields (``add_engine_flags``) and read back
with ``EngineConfig.from_args``. A message names what the user wrote: the flag on the command line, the
keyword in Python. What needs the models (a method without a drafter, a context longer than the target's,
a budget past the compiled node buckets) is checked by the engine once they are loaded.

Imports nothing heavy: building ``ddtree --help`` reads these fields.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from dataclasses import InitVar, dataclass, field
from typing import Any

from ddtree.argparsing import comma_list
from ddtree.errors import DDTreeError
from ddtree.request.params import (
    AUTO,
    METHODS,
    check_accept_thresholds,
    check_speculative_options,
    memory_size,
    parse_budget,
    parse_size,
)

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")  # a dtype: the model's, or float32
ATTENTION_BACKENDS = ("sdpa", "flex")  # with fixed shapes: SDPA over a span bucket, or FlexAttention per row
PREFILL_GAP_ROUNDS = 4.0  # while requests decode, a prefill step takes about this many rounds' time at most


def flag(
    default: Any,
    *names: str,
    help: str,
    hidden: tuple[str, ...] = (),
    unset: Any = dataclasses.MISSING,
    repr: bool = True,
    **argparse_options,
) -> Any:
    """A field set by the flag ``names[0]`` (aliases after it; ``hidden``: older spellings, not in --help).
    ``unset``: the flag's value when not given, where the command derives the field from other flags."""
    metadata = {"flags": names, "hidden": hidden, "help": help, "argparse": argparse_options, "unset": unset}
    return field(default=default, repr=repr, metadata=metadata)


def _ints(flag: str):
    return comma_list(int, flag)


@dataclass(frozen=True)
class EngineConfig:
    """An engine's options; constructing one checks them all (``DDTreeError``, one line)."""

    # -- speculation: what every request gets unless it asks otherwise
    method: str = flag(
        "ddtree", "--method", choices=METHODS,
        help="ddtree: draft tree; dflash: the drafter's argmax chain; ar: plain decoding",
    )  # fmt: skip
    budget: int | str = flag(
        AUTO, "--budget", type=parse_budget,
        help="ddtree: draft tree nodes per round, or 'auto' (chosen per round from the measured cost and "
        "calibrated acceptance; plain rounds where drafting does not pay)",
    )  # fmt: skip
    topk: int | None = flag(
        None, "--draft-topk", type=int, metavar="K", hidden=("--topk",),
        help="ddtree: cap on tree candidates per depth (SGLang's --speculative-eagle-topk; default: the "
        "budget)",
    )  # fmt: skip
    accept_threshold_single: float = flag(
        1.0, "--speculative-accept-threshold-single", type=float, metavar="P",
        help="SGLang's threshold_single: accept a drafted token whose target probability is >= P; LOSSY "
        "below 1.0 (output no longer follows the target's distribution)",
    )  # fmt: skip
    accept_threshold_acc: float = flag(
        1.0, "--speculative-accept-threshold-acc", type=float, metavar="A",
        help="SGLang's threshold_acc: accept when coin < (siblings' target mass) / A; LOSSY below 1.0",
    )  # fmt: skip
    auto_max_budget: int = 64  # budget "auto": the most drafted nodes a round may choose
    tensor_parallel_size: int = flag(
        1, "--tensor-parallel-size", "-tp", type=int, metavar="N",
        help="shard the target over N ranks (Megatron-style; gloo on CPUs, NCCL on GPUs 0..N-1); ddtree "
        "starts them, or run under torchrun with N processes",
    )  # fmt: skip
    # -- batch and memory (vLLM's names)
    max_num_seqs: int = flag(
        16, "--max-num-seqs", "--max-batch-size", type=int,
        help="requests (choices) the engine runs side by side",
    )  # fmt: skip
    max_model_len: int | None = flag(
        None, "--max-model-len", type=int, metavar="N",
        help="tokens per request, prompt and output (default: the model's context)",
    )  # fmt: skip
    kv_cache_memory: int | str | None = flag(
        None, "--kv-cache-memory", type=memory_size, metavar="SIZE",
        help="KV cache bytes (4GiB, 512MiB, ...); wins over --gpu-memory-utilization",
    )  # fmt: skip
    gpu_memory_utilization: float = flag(
        0.9, "--gpu-memory-utilization", type=float, metavar="F",
        help="share of the device's memory (on a CPU, of the RAM available) the engine may use: the KV cache "
        "gets what weights and activations leave",
    )  # fmt: skip
    max_num_batched_tokens: int = flag(
        2048, "--max-num-batched-tokens", type=int, metavar="N",
        help="tokens a step may prefill; longer prompts are prefilled in chunks, between rounds of the "
        "running requests",
    )  # fmt: skip
    block_size: int = flag(16, "--block-size", type=int, help="tokens per KV cache block")
    kv_cache_dtype: str = flag(
        "auto", "--kv-cache-dtype", choices=KV_CACHE_DTYPES,
        help="dtype of the KV cache's keys and values: the model's, or float32 for a bf16 / fp16 model (same "
        "numbers, twice the bytes; MLA latents stay in the model's dtype); auto: the model's, except float32 "
        "on a CPU where that costs no context (its attention runs several times faster over float32 keys)",
    )  # fmt: skip
    enable_prefix_caching: bool = flag(
        True, "--enable-prefix-caching", action=argparse.BooleanOptionalAction,
        help="reuse the KV blocks (and the drafter's context) of prompt prefixes that earlier requests "
        "computed, instead of prefilling them again",
    )  # fmt: skip
    prefill_gap_rounds: float | None = PREFILL_GAP_ROUNDS  # None: max_num_batched_tokens alone
    # -- fixed shapes and compilation
    compile: bool = flag(
        False, "--compile", action="store_true",
        help="pad every round to fixed shapes and torch.compile the target and drafter forwards (CUDA graphs "
        "on CUDA); every shape compiles at start-up, which takes minutes on a CPU",
    )  # fmt: skip
    fixed_shapes: bool | None = None  # None: as compile (fixed shapes without compiling: tests, debugging)
    batch_buckets: tuple[int, ...] | None = flag(
        None, "--batch-buckets", type=_ints("--batch-buckets"), metavar="B1,B2,...",
        help="with --compile: the batch sizes to compile, comma-separated, the largest being the maximum "
        "batch size (default: 1, 2, 4, ... up to it); fewer buckets start faster",
    )  # fmt: skip
    node_buckets: tuple[int, ...] | None = flag(
        None, "--node-buckets", type=_ints("--node-buckets"), metavar="N1,N2,...",
        help="with --compile: the tree sizes to compile (root included), comma-separated; the largest must "
        "hold the budget plus one (default: 1, 2, 3, 5, 9, 17, ... up to it)",
    )  # fmt: skip
    span_buckets: tuple[int, ...] | None = flag(
        None, "--span-buckets", type=_ints("--span-buckets"), metavar="S1,S2,...",
        help="with --compile: cache columns attention may read, comma-separated; the whole row is always one "
        "(the default: only it); on a CPU, a few smaller spans make short rows read less",
    )  # fmt: skip
    attention: str = flag(
        "sdpa", "--attention-backend", choices=ATTENTION_BACKENDS,
        help="with --compile: 'flex' reads each row's own KV blocks up to its length (FlexAttention over the "
        "paged pool) instead of a span of every row",
    )  # fmt: skip
    # -- numerics
    batch_invariant: bool = flag(
        False, "--batch-invariant", action="store_true", hidden=("--enable-deterministic-inference",),
        help="compute every request as it would be computed alone (in bf16/fp16; seeded samples always "
        "are): greedy output then equals plain decoding's token for token at any batch and method, at "
        "the batch-invariant path's cost (eager rounds, float64 attention)",
    )  # fmt: skip
    draft_dtype: Any = None  # the drafter's torch dtype, when it differs from the target's
    profile: bool = False  # time every stage (waits for the device at each stage boundary)
    from_flags: InitVar[bool] = False  # messages name flags (the command line) rather than keywords

    def __post_init__(self, from_flags: bool) -> None:
        name = (lambda f: FIELD_FLAGS.get(f, f)) if from_flags else (lambda f: f)
        check_speculative_options(self.method, self.budget, self.topk)
        check_accept_thresholds(self.accept_threshold_single, self.accept_threshold_acc)
        for f in (
            "auto_max_budget",
            "tensor_parallel_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
        ):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DDTreeError(f"{name(f)} must be an integer >= 1, got {value!r}")
        m = self.max_model_len
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 2):
            raise DDTreeError(f"{name('max_model_len')} must be an integer >= 2, got {m!r}")
        g = self.prefill_gap_rounds
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not g > 0):
            raise DDTreeError(f"prefill_gap_rounds must be a number > 0 or None, got {g!r}")
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_size(self.kv_cache_memory))
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise DDTreeError(f"{name('gpu_memory_utilization')} must be in (0, 1], got {u!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise DDTreeError(f"{name('kv_cache_dtype')} must be one of {', '.join(KV_CACHE_DTYPES)}")
        self._check_shapes(name, from_flags)

    def _check_shapes(self, name, from_flags: bool) -> None:
        from ddtree.model.capture import (  # numpy and torch: only to check these
            check_batch_buckets,
            check_buckets,
        )

        def setting(f: str, value: Any) -> str:
            if not from_flags:
                return f"{f}={value!r}"
            return FIELD_FLAGS[f] if value is True else f"{FIELD_FLAGS[f]} {value}"

        compiled = setting("compile", True)
        if self.attention not in ATTENTION_BACKENDS:
            raise DDTreeError(f"{name('attention')} must be one of {', '.join(ATTENTION_BACKENDS)}")
        if self.attention == "flex" and not self.compile:
            raise DDTreeError(
                f"{setting('attention', 'flex')} needs {compiled} "
                "(uncompiled, FlexAttention is a dense fallback)"
            )
        if self.attention == "flex" and self.span_buckets is not None:
            raise DDTreeError(
                f"{name('span_buckets')} is for {setting('attention', 'sdpa')}; "
                "flex reads each row's own length"
            )
        if self.compile and self.fixed_shapes is False:
            raise DDTreeError("compile=True needs fixed shapes (fixed_shapes=False was given)")
        if not self.fixed:
            for f in ("batch_buckets", "node_buckets", "span_buckets"):
                if getattr(self, f) is not None:
                    raise DDTreeError(
                        f"{name(f)} needs {compiled if from_flags else 'fixed shapes (compile=True)'}"
                    )
            return
        buckets = check_batch_buckets(name("batch_buckets"), self.batch_buckets, self.max_num_seqs)
        object.__setattr__(self, "batch_buckets", buckets)
        object.__setattr__(self, "node_buckets", check_buckets(name("node_buckets"), self.node_buckets))
        object.__setattr__(self, "span_buckets", check_buckets(name("span_buckets"), self.span_buckets))

    @property
    def fixed(self) -> bool:
        """Rounds are padded to fixed shapes (compiled, or asked for)."""
        return self.compile if self.fixed_shapes is None else bool(self.fixed_shapes)

    @classmethod
    def build(cls, config: EngineConfig | None = None, **options) -> EngineConfig:
        """``config`` (or the defaults) with ``options`` over it; ``max_batch_size`` is the older name of
        ``max_num_seqs``."""
        if "max_batch_size" in options:
            alias = options.pop("max_batch_size")
            if alias is not None:
                given = options.get("max_num_seqs", alias)
                if given is not None and given != alias:
                    raise DDTreeError(
                        f"max_num_seqs ({given}) and its alias max_batch_size ({alias}) disagree"
                    )
                options["max_num_seqs"] = alias
        if options.get("max_num_seqs", 0) is None:
            options.pop("max_num_seqs")
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return dataclasses.replace(config or cls(), **options)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> EngineConfig:
        """The config the flags describe (those ``add_engine_flags`` gave this command; others keep their
        defaults), with ``overrides`` (what the command decides itself); messages name the flags."""
        values = {f: getattr(args, f) for f in FIELD_FLAGS if f in args}
        return cls(**(values | overrides), from_flags=True)


def field_flags(cls: type) -> dict[str, str]:
    """Each flagged field of the dataclass ``cls`` -> its flag."""
    return {f.name: f.metadata["flags"][0] for f in dataclasses.fields(cls) if f.metadata}


FIELD_FLAGS = field_flags(EngineConfig)

SPECULATIVE_FLAGS = ("method", "budget", "topk", "accept_threshold_single", "accept_threshold_acc")
PARALLEL_FLAGS = ("tensor_parallel_size",)
MEMORY_FLAGS = (
    "max_model_len",
    "kv_cache_memory",
    "gpu_memory_utilization",
    "max_num_batched_tokens",
    "block_size",
    "kv_cache_dtype",
    "enable_prefix_caching",
)
COMPILE_FLAGS = ("compile", "batch_buckets", "node_buckets", "span_buckets", "attention")
BATCH_FLAGS = ("max_num_seqs",)
NUMERICS_FLAGS = ("batch_invariant",)


def add_engine_flags(p: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """The flags of these EngineConfig fields, with the fields' defaults (``dest`` is the field)."""
    add_field_flags(p, EngineConfig, names)


def add_field_flags(p: argparse.ArgumentParser, cls: type, names: Iterable[str]) -> None:
    """The flags of these fields of ``cls`` (made with ``flag``), with the fields' defaults (``dest`` is the
    field)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        f = fields[name]
        meta = f.metadata
        unset = meta.get("unset", dataclasses.MISSING)
        default = f.default if unset is dataclasses.MISSING else unset
        p.add_argument(*meta["flags"], dest=name, default=default, help=meta["help"], **meta["argparse"])
        if meta["hidden"]:
            p.add_argument(
                *meta["hidden"], dest=name, default=default, help=argparse.SUPPRESS, **meta["argparse"]
            )
