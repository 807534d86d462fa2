"""Prometheus metrics, in a registry owned by one app (no global state: two apps never share counters).

Speculative-decoding counters follow vLLM's ``spec_decode_*`` family: ``rounds`` (vLLM's drafts),
``accepted_tokens`` (draft tokens the target kept), ``accepted_tokens_per_pos`` (rounds whose draft
was accepted at least up to depth ``position + 1``) and ``emitted_tokens`` (accepted + the bonus), so
``emitted / rounds`` is tau, the mean acceptance length; ``mean_acceptance_length`` exports it directly.

Batching follows vLLM's names where they exist: ``num_requests_running`` / ``num_requests_waiting`` count
engine rows (one per choice), ``time_to_first_token_seconds`` and ``inter_token_latency_seconds`` time
what clients see; ``step_rows`` and ``step_duration_seconds`` describe the engine's steps.
``requests_running`` and ``queue_depth`` count HTTP requests.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/ready",
    "/metrics",
)


class Metrics:
    """Everything ``GET /metrics`` reports."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "ddtree_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "ddtree_request_duration_seconds",
            "Time from request to the last byte of the answer",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "ddtree_queue_wait_seconds",
            "Time a request waited for the engine",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "ddtree_time_to_first_token_seconds",
            "Time from request to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "ddtree_inter_token_latency_seconds",
            "Time between two successive deltas (engine steps that gave tokens) of one choice",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "ddtree_queue_depth",
            "HTTP requests waiting for the engine (none of their rows started)",
            registry=r,
        )
        self.running = Gauge(
            "ddtree_requests_running", "HTTP requests the engine is generating for", registry=r
        )
        self.rows_running = Gauge(
            "ddtree_num_requests_running", "Engine rows (one per choice) in the running batch", registry=r
        )
        self.rows_waiting = Gauge(
            "ddtree_num_requests_waiting",
            "Engine rows (one per choice) waiting for a place in the batch",
            registry=r,
        )
        self.kv_blocks = Gauge(
            "ddtree_kv_cache_blocks",
            "KV cache blocks of the pool, by state (used, free; the scratch block is in neither)",
            ["state"],
            registry=r,
        )
        self.kv_usage = Gauge(
            "ddtree_kv_cache_usage_perc", "Share of the KV cache blocks in use (0-1)", registry=r
        )
        self.preemptions = Counter(
            "ddtree_num_preemptions",
            "Running requests preempted (their KV blocks freed, recomputed later) for lack of blocks",
            registry=r,
        )
        # vLLM's names and units (tokens), so its dashboards' hit-rate panel reads ours
        self.prefix_queries = Counter(
            "ddtree_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at admission",
            registry=r,
        )
        self.prefix_hits = Counter(
            "ddtree_prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled)", registry=r
        )
        self._prefix_seen = (0, 0)  # the engine's totals the counters have counted
        self.step_rows = Histogram(
            "ddtree_step_rows",
            "Rows in one engine step's round (the running batch; the rows it admits start next step)",
            buckets=ROW_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "ddtree_step_duration_seconds", "Time of one engine step", buckets=STEP_BUCKETS, registry=r
        )
        self.cancelled = Counter(
            "ddtree_requests_cancelled",
            "Generations stopped early, by reason (disconnect, timeout)",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("ddtree_prompt_tokens", "Prompt tokens processed", registry=r)
        self.completion_tokens = Counter("ddtree_generation_tokens", "Tokens generated", registry=r)
        self.rounds = Counter(
            "ddtree_spec_decode_rounds",
            "Decode rounds (one target verify forward each)",
            ["method"],
            registry=r,
        )
        self.accepted = Counter(
            "ddtree_spec_decode_accepted_tokens",
            "Draft tokens accepted by the target",
            ["method"],
            registry=r,
        )
        self.emitted = Counter(
            "ddtree_spec_decode_emitted_tokens", "Tokens committed by decode rounds", ["method"], registry=r
        )
        self.accepted_per_pos = Counter(
            "ddtree_spec_decode_accepted_tokens_per_pos",
            "Rounds whose accepted draft reached depth position + 1",
            ["method", "position"],
            registry=r,
        )
        self.tau = Gauge(
            "ddtree_spec_decode_mean_acceptance_length",
            "Tokens per decode round since start (tau)",
            ["method"],
            registry=r,
        )
        self.drafted = Counter(
            "ddtree_spec_decode_drafted_tokens",
            "Drafted tree nodes verified by the target (what budget auto chose, summed)",
            ["method"],
            registry=r,
        )
        self.auto_drafting = Gauge(
            "ddtree_auto_drafting",
            "budget auto: 1 while the chosen trees pay, 0 while auto rows run plain rounds between probes",
            registry=r,
        )
        self.auto_seconds = Gauge(
            "ddtree_auto_cost_seconds",
            "budget auto's measured costs: a drafter pass over the auto rows, a round without the drafter",
            ["part"],
            registry=r,
        )
        self.auto_first_draft = Gauge(
            "ddtree_auto_first_draft_acceptance",
            "budget auto: share of recent rounds whose likeliest first draft was the target's token",
            registry=r,
        )
        self._totals: dict[str, list[int]] = {}  # method -> [rounds, emitted], for the tau gauge

    def record_generation(
        self, method: str, acceptance_lengths: Iterable[int], completion_tokens: int, drafted: int = 0
    ) -> None:
        """One finished (or stopped) choice: its tokens, its rounds and its drafted nodes."""
        lengths = list(acceptance_lengths)
        self.completion_tokens.inc(completion_tokens)
        self.drafted.labels(method).inc(drafted)
        if not lengths:
            return
        self.rounds.labels(method).inc(len(lengths))
        self.emitted.labels(method).inc(sum(lengths))
        self.accepted.labels(method).inc(sum(lengths) - len(lengths))
        for position in range(max(lengths) - 1):
            self.accepted_per_pos.labels(method, str(position)).inc(sum(n - 1 > position for n in lengths))
        totals = self._totals.setdefault(method, [0, 0])
        totals[0] += len(lengths)
        totals[1] += sum(lengths)
        self.tau.labels(method).set(totals[1] / totals[0])

    def record_prefix_cache(self, queried: int, hit: int) -> None:
        """The engine's running totals of prompt tokens looked up and found (counters only go up)."""
        seen_queried, seen_hit = self._prefix_seen
        self.prefix_queries.inc(queried - seen_queried)
        self.prefix_hits.inc(hit - seen_hit)
        self._prefix_seen = (queried, hit)

    def record_auto(self, status) -> None:
        """The engine's budget-auto decision (``AutoStatus``), after each step."""
        self.auto_drafting.set(int(status.drafting))
        self.auto_seconds.labels("draft").set(status.draft_ms / 1e3)
        self.auto_seconds.labels("plain_round").set(status.plain_round_ms / 1e3)
        if status.first_draft_acceptance is not None:
            self.auto_first_draft.set(status.first_draft_acceptance)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts every HTTP answer by endpoint and status and times it to its last byte (streams included)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets when the app raises before answering

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in ENDPOINTS else "other"  # unknown paths must not grow the label set
            if path.startswith("/v1/models/"):
                endpoint = "/v1/models/{model}"
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
