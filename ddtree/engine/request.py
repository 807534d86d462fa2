"""Request state and what the engine hands back: plain dataclasses, no behaviour beyond their own sums.

``Request`` is public so a scheduler (and a curious caller) can see where each request stands; the engine's
parts own its fields as their docstrings say.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ddtree.request.logprobs import TokenLogprobs
from ddtree.request.output import OutputState
from ddtree.request.params import AUTO, SamplingParams, lossy_threshold_fields
from ddtree.request.stats import mean_acceptance_length

if TYPE_CHECKING:  # xgrammar is imported only by engines that get a structured-output request
    from ddtree.request.grammar import GrammarState
    from ddtree.request.penalties import RequestPenalties

STAGES = ("draft", "tree", "inputs", "verify", "accept", "commit")


class RequestStatus(enum.Enum):
    """Where a request stands; only the ``Scheduler`` moves it (vLLM's ``RequestStatus``)."""

    WAITING = "waiting"  # queued, never admitted
    PREFILLING = "prefilling"  # admitted: its ``prefill_ids`` are going into the cache, chunk by chunk
    RUNNING = "running"  # decoding: a row of every round
    PREEMPTED = "preempted"  # its blocks were taken back: queued first, to prefill prompt and output again
    FINISHED = "finished"  # stopped, aborted or failed (``output.finish_reason`` says which): gone


@dataclass
class AutoStatus:
    """What budget "auto" does and why (``--stats``, the responses' ``ddtree`` object, ``/metrics``)."""

    drafting: bool = True  # False while auto rows run plain rounds between probes
    reason: str = "drafting: the chosen trees are expected to pay"
    drafted_rounds: int = 0  # auto rows' rounds that verified at least one drafted node
    plain_rounds: int = 0  # auto rows' rounds without a drafted node (stretches, and rounds that chose none)
    first_drafts: int = 0  # recent rounds whose first draft was checked against the target
    first_drafts_accepted: int = 0  # ... and would have been (or was) accepted
    draft_ms: float = 0.0  # a drafter pass over the auto rows, predicted by the cost model
    plain_round_ms: float = 0.0  # a round without the drafter, predicted
    stretch: int = 0  # plain rounds left before the next probe

    @property
    def first_draft_acceptance(self) -> float | None:
        return self.first_drafts_accepted / self.first_drafts if self.first_drafts else None

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["first_draft_acceptance"] = self.first_draft_acceptance
        return out


@dataclass
class GenerationStats:
    """What a response cost. ``acceptance_lengths`` has one entry per round: accepted drafts + 1.

    Stage, prefill and decode seconds are the wall time of the batched forwards and rounds the request
    took part in (shared with its batch companions). Stage seconds are measured only when the engine
    profiles (``Engine(profile=True)``): timing a stage on an accelerator means waiting for it.
    """

    method: str
    budget: int | str  # "auto": chosen per round (see drafted_nodes)
    prompt_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    drafted_nodes: list[int] = field(default_factory=list)  # drafted nodes verified per round
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    preemptions: int = 0  # times the request lost its KV blocks and was recomputed
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission (not prefilled)
    accept_thresholds: tuple[float, float] = (1.0, 1.0)  # (single, acc); below 1.0 the output is lossy
    auto: AutoStatus | None = None  # budget "auto": the engine's decision at this request's last round

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length (tokens committed per target forward after prefill)."""
        return mean_acceptance_length(self.acceptance_lengths)

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        out = {
            "method": self.method,
            "budget": self.budget,
            "prompt_tokens": self.prompt_tokens,
            "rounds": self.rounds,
            "tau": self.tau,
            "acceptance_lengths": list(self.acceptance_lengths),
            "drafted_nodes": list(self.drafted_nodes),
            "stage_seconds": dict(self.stage_seconds),
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "decode_tokens": self.decode_tokens,
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "preemptions": self.preemptions,
            "cached_tokens": self.cached_tokens,
        }
        if self.auto is not None:
            out["auto"] = self.auto.as_dict()
        return out | lossy_threshold_fields(*self.accept_thresholds)


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # aligned with token_ids when requested
    request_id: str = ""
    error: str | None = None  # finish_reason "error": why this request failed (the others went on)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token (first: None), if asked


@dataclass
class StreamDelta:
    """What one step added to one request: new token ids and the newly stable text (may be empty)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stats: GenerationStats
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # aligned with token_ids when requested
    error: str | None = None  # finish_reason "error": why this request failed (the others went on)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # the prompt's, in the first delta, if asked


@dataclass(eq=False)  # a request is itself: compared (and found in lists) by identity
class Request:
    """One request's decoding state, public so a scheduler can see it.

    While it runs it owns the KV blocks ``blocks`` (its block table, the same in the target's and the
    drafter's pool), the first of them perhaps shared with other requests through the prefix cache. A
    prefill puts ``prefill_ids`` in the cache, ``computed`` of them so far (in chunks when long; a prefix
    cache hit counts as computed); after that the cache holds the committed tokens at columns [0, start)
    and the root (the last emitted token, not yet in the cache) sits at position ``start``. A drafting
    request's drafter cache holds [0, draft_len) (positions shifted by ``draft_skipped`` past
    ``draft_gap``), and ``features`` the target features of the tokens it has not consumed yet. A
    preempted request loses all of that and is prefilled again from its prompt and output (its cached
    prefix, if still cached, excepted).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    method: str
    budget: int | str
    topk: int | None
    output: OutputState
    stats: GenerationStats
    generator: torch.Generator  # coins of SGLang's rule (lossy thresholds only)
    blocks: list[int] = field(default_factory=list)
    prefill_ids: list[int] = field(default_factory=list)
    computed: int = 0
    start: int = 0
    root: int = -1
    draft_len: int = 0
    draft_skipped: int = 0  # positions the drafter never consumed (a backlog's oldest, dropped): column c
    # of its cache past ``draft_gap`` holds position c + draft_skipped
    draft_gap: int = -1  # the first such column (-1: none; the cache holds its own positions throughout)
    features: list[torch.Tensor] = field(default_factory=list)  # [C_i, F * H] per round not drafted on
    auto_width: int = 8  # budget "auto": drafted nodes chosen last time (sizes the next candidate tree)
    auto_rest: int = 0  # budget "auto": plain rounds this row takes alone, skipping the drafter pass ...
    auto_backoff: int = 0  # ... and the length of its last such rest (doubling while its drafts do not pay)
    auto_worth: float = -1.0  # moving average of the tokens its drafts were expected to bring (-1: none)
    cache_salt: str | None = None  # requests with different salts share no cached block
    grammar: GrammarState | None = None  # structured outputs: where its output is in its grammar
    penalties: RequestPenalties | None = None  # penalties and biases, resolved at admission
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks so far
    cached_blocks: int = 0  # of its blocks, those already indexed in the prefix cache (or examined)
    error: str | None = None  # why a step failed for this request alone (finish_reason "error")
    key: int = 0  # its coins' key (``speculative.coins``): the seed's, or drawn at admission
    invariant: bool = False  # computed batch-invariantly whatever it samples (``batch_invariant``)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # the prompt's so far (prompt_logprobs)
    status: RequestStatus = RequestStatus.WAITING

    @property
    def prefilling(self) -> bool:
        """Admitted, but its prefill (``prefill_ids``) is not all in the cache yet."""
        return self.status is RequestStatus.PREFILLING

    @property
    def drafts(self) -> bool:
        return self.method != "ar"

    @property
    def scores_prompt(self) -> bool:
        """It asked for its prompt's logprobs and has prompt tokens left to score (computed in the prefill,
        so none of them may come from the prefix cache)."""
        scored = len(self.prompt_logprobs or [])
        return self.params.prompt_logprobs is not None and scored < len(self.prompt_ids)

    @property
    def draft_aligned(self) -> int:
        """Drafter cache columns that hold their own positions (what a prefix-cache hit may reuse)."""
        return self.draft_len if self.draft_gap < 0 else self.draft_gap

    @property
    def auto(self) -> bool:
        return self.budget == AUTO

    @property
    def auto_kind(self) -> str:
        """Which of budget auto's records this row learns from and is judged by: greedy and sampled
        acceptance differ."""
        return "greedy" if self.params.greedy else "sampled"

    @property
    def exact(self) -> bool:
        """Its tokens must not depend on its batch or method: a seeded sample, or every request of a
        ``batch_invariant`` engine (``model.invariance``)."""
        return self.invariant or (self.params.seed is not None and not self.params.greedy)


@dataclass
class StepOutput:
    """A step's results for its rows (lists aligned with ``rows``), applied by
    ``Scheduler.update_from_output``: the one place a step changes its requests. The parts that computed
    them (proposer, verifier, auto budget) only read requests."""

    rows: list[Request]
    tokens: list[list[int]]  # tokens each row commits (none for a chunk that does not end a prefill)
    logprobs: list[list[TokenLogprobs] | None]  # their log-probabilities, when the row asked for them
    consumed: list[int]  # context features each row's drafter consumed (dropped from its pending ones)
    features: list[torch.Tensor | None]  # new target features for each row's drafter to consume [m, F * H]
    prefilled: list[int] | None = None  # a prefill step: the tokens each row's chunk put in the cache
    seconds: float = 0.0  # a prefill step's wall time (a round's is recorded after its commit)
    drafted_nodes: list[int] | None = None  # a round: drafted nodes each row verified
    auto_widths: dict[int, int] = field(default_factory=dict)  # auto rows' chosen widths, by row index
    auto_skip: dict[str, int] | None = None  # plain rounds auto rows now take, by kind (None: no new stretch)
    auto_rests: dict[int, tuple[int, float]] = field(default_factory=dict)  # rows' own plain rounds (0:
    # draft on) and their drafts' average worth, by row
    auto_status: AutoStatus | None = None  # the auto policy after this round, for its rows' stats
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None  # a prefill: the chunk's prompt tokens
