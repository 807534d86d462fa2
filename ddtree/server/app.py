"""The app factory: ``create_app(engine_factory, config)`` builds a FastAPI app that owns its engine worker.

Nothing lives at module level: each app has its own worker thread, queue, metrics registry and
identity, so tests (or one process) can run several side by side. The engine is built by
``engine_factory`` on the worker thread when the app starts; until it has loaded and a warm-up
generation succeeded, ``/ready`` and the generation endpoints answer 503 while ``/health`` answers 200.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ddtree.errors import DDTreeError
from ddtree.request.params import SamplingParams
from ddtree.server.auth import APIKeyMiddleware
from ddtree.server.body import BodyParser
from ddtree.server.config import ServerConfig, chat_template_text
from ddtree.server.errors import APIError, error_body, install_error_handlers
from ddtree.server.generation import ServedModel
from ddtree.server.limits import BodySizeLimit, longest_token_chars
from ddtree.server.metrics import Metrics, MetricsMiddleware
from ddtree.server.openai_api import router as openai_router
from ddtree.server.protocol import Health, NotReady
from ddtree.server.responses_api import router as responses_router
from ddtree.server.tokenize_api import router as tokenize_router
from ddtree.server.tokens import TokenNames
from ddtree.server.worker import EngineWorker

NOT_READY = {
    "loading": ("the model is loading", "model_loading"),
    "warming": ("the model is warming up", "model_warming_up"),
    "failed": ("the model failed to load", "model_load_failed"),
    "dead": ("the engine stopped", "engine_failed"),
}


@dataclass
class ServerState:
    """Everything one app owns; routes reach it as ``request.app.state.ddtree``."""

    config: ServerConfig
    worker: EngineWorker
    metrics: Metrics
    pid: int = field(default_factory=os.getpid)
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: float = field(default_factory=time.time)
    token_chars: int | None = None  # the tokenizer's longest token in characters, once loaded
    ignored_fields_logged: set[str] = field(default_factory=set)  # request fields ignored, logged once
    seeds: random.Random | None = None  # --seed: the seeds of requests that give none

    def __post_init__(self) -> None:
        if self.config.seed is not None:
            self.seeds = random.Random(self.config.seed)

    def health(self) -> Health:
        return Health(
            status="ok",
            state=self.worker.state,
            pid=self.pid,
            instance_id=self.instance_id,
            started_at=datetime.fromtimestamp(self.started_at, UTC).isoformat(),
            uptime_seconds=round(time.time() - self.started_at, 3),
            phase=self.worker.phase if self.worker.progress is not None else None,
        )

    def not_ready(self) -> APIError | None:
        """The 503 to answer while the engine cannot serve, or None once it can."""
        if self.worker.state == "ready":
            return None
        message, code = NOT_READY[self.worker.state]
        if self.worker.load_error:
            message = f"{message}: {self.worker.load_error}"
        elif self.worker.progress is not None:
            message = f"{message} ({self.worker.progress})"
        return APIError(
            503, message, "service_unavailable", None, code, {"Retry-After": str(self.config.retry_after)}
        )

    def model(self) -> ServedModel:
        error = self.not_ready()
        if error is not None:
            raise error
        return self.worker.engine


def load_model(engine_factory: Callable[[], object], config: ServerConfig | None = None) -> ServedModel:
    """The engine ``engine_factory`` builds, with ``--tokenizer`` and ``--chat-template`` applied."""
    engine = engine_factory()
    if config is not None and config.tokenizer is not None:
        engine.tokenizer = load_tokenizer(config.tokenizer, engine.vocab_size, config.trust_remote_code)
    if config is not None and config.chat_template is not None:
        if engine.tokenizer is None:
            raise DDTreeError("--chat-template needs a tokenizer; this target has none")
        engine.tokenizer.chat_template = chat_template_text(config.chat_template)
    return ServedModel(engine, TokenNames(engine.tokenizer), engine.max_model_len)


def load_tokenizer(directory: str, vocab_size: int, trust_remote_code: bool = False):
    """``--tokenizer``: its ids must all be the target's."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise DDTreeError(f"cannot load --tokenizer {directory}: {exc}") from None
    if len(tokenizer) > vocab_size:
        raise DDTreeError(
            f"--tokenizer {directory} has {len(tokenizer)} tokens, more than the target's {vocab_size}"
        )
    return tokenizer


def warm_up(model: ServedModel) -> None:
    """One short generation, so the first client does not pay for lazy initialisation (and it works);
    token ids in and out, as every request on the engine thread."""
    model.engine.generate([0], SamplingParams(max_new_tokens=2, ignore_eos=True, detokenize=False))


def create_app(
    engine_factory: Callable[[], object],
    config: ServerConfig | None = None,
    on_load_failed: Callable[[BaseException], None] | None = None,
    on_engine_failed: Callable[[str], None] | None = None,
) -> FastAPI:
    """An OpenAI-compatible app serving the engine ``engine_factory`` builds (on the worker thread)."""
    config = config or ServerConfig()
    metrics = Metrics()

    def load() -> ServedModel:
        model = load_model(engine_factory, config)
        state.token_chars = longest_token_chars(model.engine.tokenizer)
        return model

    worker = EngineWorker(
        load,
        metrics,
        config.max_queue,
        warm_up,
        on_load_failed=on_load_failed,
        step_delay=config.step_delay,
        on_engine_failed=on_engine_failed,
    )
    state = ServerState(config, worker, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        if config.start_body_parser:
            await app.state.body_parser.start()
        yield
        await app.state.body_parser.close()
        await asyncio.to_thread(worker.stop, config.engine_stop_timeout)

    app = FastAPI(
        title="ddtree",
        summary="OpenAI-compatible server for lossless speculative decoding with DDTree",
        lifespan=lifespan,
    )
    app.state.ddtree = state
    app.state.body_parser = BodyParser()  # large bodies are read in its processes, off the event loop
    install_error_handlers(app)
    # The last added runs first: metrics see every answer; CORS answers preflights (which carry no key)
    # before the key check; the body is read, within its limit, only for a request with a valid key.
    app.add_middleware(BodySizeLimit, limit=config.limits.max_request_bytes)
    app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys, metrics_api_keys=config.metrics_api_keys)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.include_router(openai_router)
    app.include_router(responses_router)
    app.include_router(tokenize_router)

    @app.get("/health", response_model=Health, tags=["operations"])
    def health() -> Health:
        """Liveness: 200 while the process runs, loading or not."""
        return state.health()

    @app.get("/ready", response_model=Health, responses={503: {"model": NotReady}}, tags=["operations"])
    def ready() -> Health | JSONResponse:
        """Readiness: 200 once the model is loaded and a warm-up generation succeeded, 503 before."""
        error = state.not_ready()
        if error is None:
            return state.health()
        identity = state.health().model_dump(exclude={"status"})
        body = error_body(error.message, error.type, error.param, error.code) | identity
        return JSONResponse(body, status_code=503, headers=error.headers)

    @app.get("/metrics", tags=["operations"], response_class=Response)
    def prometheus() -> Response:
        """Prometheus text format: requests, tokens, latency, queue and speculative-decoding counters."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
