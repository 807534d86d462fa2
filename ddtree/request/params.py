"""What a request may ask for, validated once so the round loop never has to: sampling parameters, the
speculative method with its tree options, and the acceptance thresholds. Every entry point (engine, CLI,
server, bench, training) checks with these functions, so a rule and its message live in one place."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ddtree.errors import DDTreeError

GREEDY_BELOW = 1e-5
METHODS = ("ddtree", "dflash", "ar")
AUTO = "auto"  # budget: chosen per round and row from expected tokens/second (ddtree.speculative.budget)
MAX_BUDGET = 4096  # a larger tree only costs the verify forward (a round drafts at most its row's room)


@dataclass(frozen=True)
class Bound:
    """What one value may be, with its one message: ``SamplingParams`` checks with it and the server's
    request models validate with it (``ddtree.server.protocol``), so a library call and an HTTP request
    refuse the same values in the same words."""

    name: str
    lo: float
    hi: float
    integer: bool = False
    lo_open: bool = False
    hi_open: bool = False
    kind: str | None = None  # the message's "must be ..." (default: "an integer" or "a number")
    text: str | None = None  # the range as the message writes it (default: [lo, hi] with its brackets)
    note: str = ""  # after the range, e.g. " (0 disables it)"

    def holds(self, value: object) -> bool:
        if not (_is_int(value) if self.integer else _is_number(value)):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo  # NaN fails every comparison
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def message(self, value: object) -> str:
        kind = self.kind or ("an integer" if self.integer else "a number")
        text = self.text or (
            f"{'(' if self.lo_open else '['}{self.lo:{'d' if self.integer else 'g'}}, "
            f"{self.hi:{'d' if self.integer else 'g'}}{')' if self.hi_open else ']'}"
        )
        return f"{self.name} must be {kind} in {text}{self.note}, got {value!r}"

    def check(self, value: object) -> object:
        """``value`` unchanged, or the DDTreeError that names the bound."""
        if not self.holds(value):
            raise DDTreeError(self.message(value))
        return value

    def schema(self) -> dict[str, float]:
        """The bound as JSON schema keywords (the server's OpenAPI document)."""
        lo = "exclusiveMinimum" if self.lo_open else "minimum"
        hi = "exclusiveMaximum" if self.hi_open else "maximum"
        return {lo: self.lo, hi: self.hi}


# What each sampling value may be (docs/inputs.md), refused where it enters: nothing that passes reaches the
# engine's float32 tensors as 0 or inf.
MAX_LOGPROBS = 20
LOGPROBS = Bound("logprobs", 0, MAX_LOGPROBS, integer=True)
PROMPT_LOGPROBS = Bound("prompt_logprobs", 0, MAX_LOGPROBS, integer=True)
# logits / T stay finite in float32; at T = 100 the law is already nearly uniform
TEMPERATURE = Bound("temperature", 0, 1e6)
MAX_TEMPERATURE = TEMPERATURE.hi
# exact in float64 and int32; a top_k above the vocabulary keeps every token
TOP_K = Bound("top_k", 0, (1 << 31) - 1, integer=True, note=" (0 disables it)")
MAX_TOP_K = TOP_K.hi
TOP_P = Bound("top_p", 0.0, 1.0, lo_open=True)
MIN_P = Bound("min_p", 0.0, 1.0)
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency, as OpenAI
PRESENCE_PENALTY = Bound("presence_penalty", *PENALTY_RANGE)
FREQUENCY_PENALTY = Bound("frequency_penalty", *PENALTY_RANGE)
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # it and its inverse scale logits: both stay finite in float32
REPETITION_PENALTY = Bound("repetition_penalty", *REPETITION_PENALTY_RANGE, kind="a finite number > 0")
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # as OpenAI
LOGIT_BIAS = Bound("logit_bias values", *LOGIT_BIAS_RANGE, kind="finite,")
SEED_RANGE = (-(1 << 63), 1 << 64)  # [lo, hi): what torch.Generator.manual_seed takes
SEED = Bound("seed", *SEED_RANGE, integer=True, hi_open=True, text="[-2**63, 2**64)")


def check_budget(budget: int | str, limit: int = MAX_BUDGET, why: str = "") -> int | str:
    """The one budget rule: "auto", or an integer of tree nodes per round in [1, ``limit``]. A tighter
    limit than MAX_BUDGET (a server's, the compiled node buckets') says where it comes from in ``why``."""
    if budget == AUTO:
        return budget
    if not _is_int(budget) or budget < 1:
        raise DDTreeError(f"budget must be an integer >= 1 or 'auto', got {budget!r}")
    if budget > limit:
        where = f" ({why})" if why else ""
        raise DDTreeError(f"budget must be at most {limit} tree nodes per round{where}, got {budget}")
    return budget


def check_speculative_options(
    method: str, budget: int | str, topk: int | None
) -> tuple[str, int | str, int | None]:
    """``method`` is one of METHODS, ``budget`` (tree nodes per round) an integer >= 1 or "auto", and
    ``topk`` (candidates per depth, None = no cap) an integer >= 1; returns them unchanged."""
    if method not in METHODS:
        raise DDTreeError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    check_budget(budget)
    if topk is not None and (not _is_int(topk) or topk < 1):
        raise DDTreeError(f"topk must be an integer >= 1, got {topk!r}")
    return method, budget, topk


@dataclass(frozen=True)
class RequestOptions:
    """How the engine runs one request, beside its sampling: the speculative method and its tree options
    (None: the engine's own) and the prefix-cache salt (requests with different salts share no block).
    The server carries a request's options to the engine as this one value."""

    method: str | None = None
    budget: int | str | None = None
    topk: int | None = None
    cache_salt: str | None = None


def parse_budget(text: str) -> int | str:
    """A budget flag's value: "auto" or an integer (validated by ``check_speculative_options``)."""
    if text.strip() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        # argparse reports an ArgumentTypeError's own message (any other error as "invalid parse_budget")
        raise argparse.ArgumentTypeError(f"budget must be an integer >= 1 or 'auto', got {text!r}") from None


_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_UNITS |= {"ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from ``4GiB``, ``512MiB``, ``8G`` (decimal), ``1e9`` or a plain integer, as vLLM reads them."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?)?b?\s*", str(text).lower())
        if m is None:
            raise DDTreeError(f"cannot read a memory size from {text!r}; write e.g. 4GiB, 512MiB or 8G")
        value = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if value < 1:
        raise DDTreeError(f"a memory size must be positive, got {text!r}")
    return value


def memory_size(text: str) -> int:
    """argparse type of ``--kv-cache-memory``."""
    try:
        return parse_size(text)
    except DDTreeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --dtype; ddtree.model.loader.resolve_dtype reads them
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


def check_accept_thresholds(single: float, acc: float) -> tuple[float, float]:
    """SGLang's ``threshold_single`` and ``threshold_acc``: finite numbers in [0, 1]; returns them as floats.

    (1, 1), the default, is lossless; anything lower accepts drafted tokens more often than the target
    would emit them (faster, no longer the target's distribution).
    """
    for name, value in (("accept_threshold_single", single), ("accept_threshold_acc", acc)):
        if not _is_number(value) or not 0.0 <= value <= 1.0:  # NaN fails both comparisons
            raise DDTreeError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(single), float(acc)


def lossy_threshold_fields(single: float, acc: float) -> dict[str, float]:
    """The thresholds as stats and responses report them: both named when either is below 1.0 (lossy),
    nothing at the lossless default."""
    if single == 1.0 and acc == 1.0:
        return {}
    return {"accept_threshold_single": single, "accept_threshold_acc": acc}


MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema, regex, grammar or the choices together


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint (vLLM's ``structured_outputs`` fields; OpenAI's ``response_format``
    ``json_schema`` is ``json``, ``json_object`` is ``json_object=True``)."""

    json: str | None = None  # a JSON schema, serialised (hashable, and what xgrammar takes)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF (xgrammar's dialect of GBNF)
    json_object: bool = False
    disable_any_whitespace: bool = False  # json: no whitespace but json.dumps' (", " and ": ")
    # The grammar holds from the token after the output's first run of these ids (a reasoning parser's
    # end of thinking, e.g. "</think>"); empty: from the first token.
    start_after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise DDTreeError(
                "structured outputs take exactly one of json, regex, choice, grammar, json_object; "
                f"got {', '.join(given) or 'none'}"
            )
        object.__setattr__(self, "start_after", tuple(self.start_after))
        if not all(_is_int(t) and t >= 0 for t in self.start_after):
            raise DDTreeError("structured outputs' start_after must be token ids")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise DDTreeError("structured outputs' choice must be a non-empty list of strings")
        texts = {name: getattr(self, name) for name in ("json", "regex", "grammar")}
        texts |= {f"choice[{i}]": c for i, c in enumerate(self.choice or ())}
        for name, text in texts.items():
            if text is not None:
                check_text(f"structured outputs' {name}", text)
        size = sum(len(x) for x in (self.json, self.regex, self.grammar) if x) + sum(
            map(len, self.choice or ())
        )
        if size > MAX_CONSTRAINT_CHARS:
            raise DDTreeError(
                f"the structured-output constraint has {size} characters; at most {MAX_CONSTRAINT_CHARS}"
            )

    @classmethod
    def of_schema(cls, schema: dict | str, disable_any_whitespace: bool = False) -> StructuredOutputs:
        """A JSON schema given as an object or as its text."""
        text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        return cls(json=text, disable_any_whitespace=disable_any_whitespace)


@dataclass(frozen=True)
class SamplingParams:
    """What the user asks of the target's distribution.

    ``temperature == 0`` (in fact any temperature below 1e-5) is greedy decoding. Otherwise the target
    distribution is ``softmax(logits / temperature)`` restricted by ``top_k`` (0 = off), ``top_p``
    (1.0 = off) and ``min_p`` (0.0 = off), renormalised; speculative decoding reproduces it exactly.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; n >= 0 = the emitted token's logprob plus the top n
    # vLLM's prompt_logprobs: each prompt token's logprob under the target (the first has none) plus the
    # top n, computed in the prefill; such a request prefills its whole prompt (no prefix-cache hit)
    prompt_logprobs: int | None = None
    detokenize: bool = True  # False: deltas carry token ids only (as vLLM's); the caller makes the text
    structured_outputs: StructuredOutputs | None = None  # what the text must match (request.grammar)
    # Penalties and biases, as vLLM's (``ddtree.request.penalties``): presence and frequency count the
    # output's tokens, repetition the prompt's too; logit_bias maps token ids to added logits (a dict is
    # kept as sorted pairs); min_tokens holds back EOS, stop token ids and stop strings until that many
    # tokens; bad_words are never completed.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    bad_words: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _strings(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for bound in (TEMPERATURE, TOP_K, TOP_P, MIN_P):
            bound.check(getattr(self, bound.name))
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise DDTreeError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None:
            SEED.check(self.seed)
        if self.logprobs is not None:
            LOGPROBS.check(self.logprobs)
        if self.prompt_logprobs is not None:
            PROMPT_LOGPROBS.check(self.prompt_logprobs)
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise DDTreeError("stop strings must be non-empty strings")
        for i, text in enumerate(self.stop):
            check_text(f"stop[{i}]", text)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise DDTreeError("structured_outputs must be a StructuredOutputs")
        self._check_penalties()

    def _check_penalties(self) -> None:
        for bound in (PRESENCE_PENALTY, FREQUENCY_PENALTY, REPETITION_PENALTY):
            bound.check(getattr(self, bound.name))
        bias = self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, dict) else list(bias)
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and _is_number(pair[1])):
                raise DDTreeError(f"logit_bias maps token ids to numbers, got {pair!r}")
            if pair[0] < 0:
                raise DDTreeError(f"logit_bias keys must be token ids >= 0, got {pair[0]}")
            if not LOGIT_BIAS.holds(pair[1]):
                raise DDTreeError(f"{LOGIT_BIAS.message(pair[1])} for token {pair[0]}")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(v)) for t, v in pairs)))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise DDTreeError(
                f"min_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_tokens!r}"
            )
        object.__setattr__(self, "bad_words", _strings(self.bad_words))
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise DDTreeError("bad_words must be non-blank strings")
        for i, text in enumerate(self.bad_words):
            check_text(f"bad_words[{i}]", text)

    @property
    def penalised(self) -> bool:
        """Whether any penalty or bias changes the target's logits (``ddtree.request.penalties``)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.bad_words
        )

    @property
    def greedy(self) -> bool:
        # As in vLLM: below 1e-5, logits / T overflows float32 and the limit distribution is the argmax.
        return self.temperature < GREEDY_BELOW


def lone_surrogate(text: str) -> int | None:
    """Where ``text`` stops being Unicode a tokenizer can encode (a lone surrogate, JSON's ``"\\ud800"``), or
    None when it is text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def check_text(name: str, text: str) -> None:
    at = lone_surrogate(text)
    if at is not None:
        raise DDTreeError(f"{name} is not valid Unicode text: a lone surrogate at character {at}")


def _strings(value: str | Sequence[str]) -> tuple[str, ...]:
    """One string or several, as a tuple (``stop``, ``bad_words``)."""
    return (value,) if isinstance(value, str) else tuple(value)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
