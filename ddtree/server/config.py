"""Every server option in one place, as ``ddtree.config.EngineConfig`` for the engine: its default, its
check, its message and the ``serve`` flag that sets it.

``ddtree serve`` generates its flags from these fields (``ddtree.server.options``) and reads them back with
``ServerConfig.from_args``; tests and embedders build a ``ServerConfig`` directly. A message names what the
user wrote: the flag on the command line, the keyword in Python.

Imports nothing heavy: building ``ddtree --help`` reads these fields.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

from ddtree.config import field_flags, flag
from ddtree.errors import DDTreeError
from ddtree.server.reasoning import REASONING_PARSERS
from ddtree.server.tool_parsers import TOOL_CALL_PARSERS

DEFAULT_MODEL_NAME = "ddtree-default"  # the built-in pair's; a served target directory gives its own name
API_KEY_ENV = "DDTREE_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
SERVER_BUDGET_LIMIT = "this server's --max-speculative-budget"  # where a refused budget's limit comes from


def _at_least(low: int, value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _namer(cls: type, from_flags: bool):
    """A field's name as a message writes it: its flag (the command line) or the keyword (Python)."""
    flags = field_flags(cls)
    return (lambda f: flags.get(f, f)) if from_flags else (lambda f: f)


@dataclass(frozen=True)
class Limits:
    """What one request may cost (``ddtree.server.limits`` checks them before the work they guard)."""

    # a 128k-token prompt is about 0.5 MB of text; 1M token ids about 7 MB of JSON
    max_request_bytes: int = flag(
        16 << 20, "--max-request-bytes", type=int, help="larger request bodies get 413"
    )
    max_tokens_per_request: int = flag(
        1 << 18, "--max-tokens-per-request", type=int,
        help="bound on n x prompts x max_tokens of one request",
    )  # fmt: skip
    # A request's tree pads every row of its round to its node bucket: one client's budget of 4096 (the
    # engine's MAX_BUDGET) would make each round of the whole batch verify 4,097 nodes a row. 256 is the
    # largest budget the tests run compiled (SGLang's and TokenSpeed's capture failures were above 8 and at
    # rows x nodes > 128, peer-lessons.md).
    max_speculative_budget: int = flag(
        256, "--max-speculative-budget", type=int, metavar="N",
        help="largest speculative.budget a request may ask for (a tree pads its whole batch's round)",
    )  # fmt: skip
    from_flags: InitVar[bool] = False

    def __post_init__(self, from_flags: bool) -> None:
        name = _namer(Limits, from_flags)
        for f in field_flags(Limits):
            value = getattr(self, f)
            if not _at_least(1, value):
                raise DDTreeError(f"{name(f)} must be >= 1, got {value!r}")


@dataclass(frozen=True)
class ServerConfig:
    """One server's options, apart from its engine's; constructing one checks them all (one line)."""

    # -- where it listens and how it stops
    host: str = flag("127.0.0.1", "--host", help="address to listen on")
    port: int = flag(8000, "--port", type=int, help="port to listen on (0: any free one)")
    model_name: str = flag(
        DEFAULT_MODEL_NAME, "--served-model-name", unset=None,
        help=f"model id clients use (the target directory's name; {DEFAULT_MODEL_NAME} for the built-ins)",
    )  # fmt: skip
    max_queue: int = flag(
        64, "--max-queue", type=int, help="requests that may wait for a place in the batch; more get 429"
    )
    request_timeout: float = flag(
        600.0, "--request-timeout", type=float, help="seconds per request, queue wait included"
    )
    shutdown_timeout: float = flag(
        30.0, "--shutdown-timeout", type=float, help="seconds in-flight requests get on SIGTERM"
    )
    log_level: str = flag(
        "info", "--log-level", choices=LOG_LEVELS, help="uvicorn's and the server's log level"
    )
    access_log: bool = flag(False, "--access-log", action="store_true", help="log every request")
    engine_stop_timeout: float = 5.0  # how long the app's shutdown waits for the engine thread to stop
    retry_after: int = 1  # seconds, sent with 429 and 503
    # -- access
    api_keys: tuple[str, ...] = flag(
        (), "--api-key", unset=None, repr=False, action="extend", nargs="+", metavar="KEY",
        help="/v1 requests need 'Authorization: Bearer KEY'; several: --api-key K1 K2, or repeat the flag "
        f"(default: the comma-separated ${API_KEY_ENV}, which keeps keys out of the process list)",
    )  # fmt: skip
    metrics_api_keys: tuple[str, ...] = flag(
        (), "--metrics-api-key", unset=None, repr=False, action="extend", nargs="+", metavar="KEY",
        help="/metrics needs one of these",
    )  # fmt: skip
    allowed_origins: tuple[str, ...] = flag(
        (), "--allowed-origins", unset=None, action="extend", nargs="+", metavar="ORIGIN",
        help="enable CORS for these browser origins (e.g. https://app.example, or *); default: off",
    )  # fmt: skip
    limits: Limits = field(default_factory=Limits)  # its fields are flags of their own
    # -- reading answers: vLLM's flags for tool calls and reasoning
    enable_auto_tool_choice: bool = flag(
        False, "--enable-auto-tool-choice", action="store_true",
        help='allow tool_choice "auto" (the default when a request has tools); needs --tool-call-parser',
    )  # fmt: skip
    tool_call_parser: str | None = flag(
        None, "--tool-call-parser", metavar="NAME",
        help=f"read tool calls out of chat answers: {', '.join(TOOL_CALL_PARSERS)}",
    )  # fmt: skip
    reasoning_parser: str | None = flag(
        None, "--reasoning-parser", metavar="NAME",
        help=f"split <think> reasoning into reasoning_content: {', '.join(REASONING_PARSERS)}",
    )  # fmt: skip
    structured_outputs_in_reasoning: bool = flag(
        False, "--structured-outputs-in-reasoning", action="store_true",
        help="with --reasoning-parser, constrain the reasoning too (vLLM's enable_in_reasoning); by default "
        "a request's structured output holds once the reasoning has ended",
    )  # fmt: skip
    disable_any_whitespace: bool = flag(
        True, "--disable-any-whitespace", action=argparse.BooleanOptionalAction,
        help="JSON structured outputs (response_format, tool calls, structured_outputs.json) allow only "
        "json.dumps' whitespace, so a model cannot spend its tokens on whitespace (vLLM's "
        "disable_any_whitespace; a request's structured_outputs.disable_any_whitespace wins)",
    )  # fmt: skip
    # -- the model's defaults and template: vLLM's flags
    tokenizer: str | None = flag(
        None, "--tokenizer", metavar="DIR", help="a tokenizer directory to use instead of the target's"
    )
    chat_template: str | None = flag(
        None, "--chat-template", metavar="FILE_OR_TEXT",
        help="a Jinja chat template (a file, or the template itself) instead of the tokenizer's",
    )  # fmt: skip
    generation_config: str = flag(
        "auto", "--generation-config", metavar="auto|vllm|DIR",
        help="default temperature, top_p, top_k, min_p and repetition_penalty of requests that leave them "
        "out: auto reads the target's generation_config.json, DIR that directory's, vllm none (OpenAI's "
        "defaults)",
    )  # fmt: skip
    seed: int | None = flag(
        None, "--seed", type=int,
        help="seed the server's sampling: requests without a seed get seeds drawn from it in arrival order",
    )  # fmt: skip
    disable_log_requests: bool = flag(
        False, "--disable-log-requests", action="store_true",
        help="accepted for vLLM's command lines; ddtree logs no request unless --access-log",
    )  # fmt: skip
    sampling_defaults: dict = field(default_factory=dict)  # read from --generation-config
    trust_remote_code: bool = False  # for --tokenizer: the command's --trust-remote-code
    # -- hooks
    step_delay: float = 0.0  # a test hook: seconds the engine thread sleeps before each step
    start_body_parser: bool = False  # a large-body parse process starts with the app, not at the first one
    from_flags: InitVar[bool] = False  # messages name flags (the command line) rather than keywords

    def __post_init__(self, from_flags: bool) -> None:
        name = _namer(ServerConfig, from_flags)
        for f in ("api_keys", "metrics_api_keys", "allowed_origins"):  # a flag's list, or none given
            object.__setattr__(self, f, tuple(getattr(self, f) or ()))
        if not _at_least(0, self.port) or self.port > 65535:
            raise DDTreeError(f"{name('port')} must be in [0, 65535], got {self.port!r}")
        if not _at_least(0, self.max_queue):
            raise DDTreeError(f"{name('max_queue')} must be >= 0, got {self.max_queue!r}")
        if not _number(self.request_timeout) or not self.request_timeout > 0:
            raise DDTreeError(f"{name('request_timeout')} must be > 0, got {self.request_timeout!r}")
        if not _number(self.shutdown_timeout) or not self.shutdown_timeout >= 0:
            raise DDTreeError(f"{name('shutdown_timeout')} must be >= 0, got {self.shutdown_timeout!r}")
        for f, names in (("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            value = getattr(self, f)
            if value is not None and value not in names:
                raise DDTreeError(f"unknown {name(f)} {value!r}; choose one of {', '.join(names)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:  # vLLM's rule
            raise DDTreeError(f"{name('enable_auto_tool_choice')} needs {name('tool_call_parser')}")
        if self.seed is not None and not (_at_least(0, self.seed) and self.seed < 1 << 63):
            raise DDTreeError(f"{name('seed')} must be in [0, 2**63), got {self.seed!r}")
        if self.generation_config not in ("auto", "vllm") and not self.sampling_defaults:
            defaults = read_generation_config(self.generation_config, name("generation_config"))
            object.__setattr__(self, "sampling_defaults", defaults)
        for f in ("tokenizer", "chat_template"):
            value = getattr(self, f)
            if value is not None and (not isinstance(value, str) or not value):
                raise DDTreeError(f"{name(f)} must be a non-empty path, got {value!r}")
        if self.chat_template is not None:
            chat_template_text(self.chat_template)  # a missing file fails here, before loading
        if self.tokenizer is not None and not Path(self.tokenizer).is_dir():
            raise DDTreeError(f"{name('tokenizer')} {self.tokenizer} is not a directory")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> ServerConfig:
        """The config the flags describe, with ``overrides`` (what the command derives itself: the model's
        name, keys from the environment); messages name the flags."""
        values = {f: getattr(args, f) for f in field_flags(cls) if getattr(args, f, None) is not None}
        values["limits"] = Limits(**{f: getattr(args, f) for f in field_flags(Limits)}, from_flags=True)
        return cls(**(values | overrides), from_flags=True)


# the request defaults vLLM reads from generation_config.json
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_config(directory: str, flag_name: str = "generation_config") -> dict:
    """The request defaults a model directory's ``generation_config.json`` sets (``SAMPLING_DEFAULTS``, as
    vLLM reads them); {} for a file that sets none."""
    path = Path(directory) / "generation_config.json"
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DDTreeError(f"cannot read {flag_name} {path}: {exc}") from None
    if not isinstance(values, dict):
        raise DDTreeError(f"{flag_name} {path} is not a JSON object")
    out = {}
    for key in SAMPLING_DEFAULTS:
        value = values.get(key)
        if value is not None:
            if not _number(value):
                raise DDTreeError(f"{flag_name} {path}: {key} must be a number, got {value!r}")
            out[key] = value
    return out


def chat_template_text(value: str) -> str:
    """``--chat-template``: a file's text, or the template itself (vLLM's rule: text with Jinja markup)."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise DDTreeError(f"cannot read --chat-template {value}: {exc}") from None
    if "{{" in value or "{%" in value:
        return value
    raise DDTreeError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
