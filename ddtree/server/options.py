"""``ddtree serve``'s flags and their defaults, in a module that imports nothing heavy: building the
command line (``ddtree --help``) loads no web framework and no model code."""

from __future__ import annotations

import argparse

from ddtree.server.reasoning import REASONING_PARSERS
from ddtree.server.tool_parsers import TOOL_CALL_PARSERS

DEFAULT_MODEL_NAME = "ddtree-default"  # the built-in pair's; a served target directory gives its own name
API_KEY_ENV = "DDTREE_API_KEY"
MAX_REQUEST_BYTES = 16 << 20  # a 128k-token prompt is about 0.5 MB of text; 1M token ids about 7 MB of JSON
MAX_TOKENS_PER_REQUEST = 1 << 18  # n x prompts x max_tokens
# A request's tree pads every row of its round to its node bucket: one client's budget of 4096 would make
# each round of the whole batch verify 4,097 nodes a row. 256 is the largest budget the tests run compiled
# (SGLang's and TokenSpeed's capture failures were above 8 and at rows x nodes > 128, peer-lessons.md).
MAX_SPECULATIVE_BUDGET = 256


def add_server_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help=f"model id clients use (the target directory's name; {DEFAULT_MODEL_NAME} for the built-ins)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait for a place in the batch; more get 429",
    )
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request, queue wait included"
    )
    p.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM"
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's and the server's log level",
    )
    p.add_argument("--access-log", action="store_true", help="log every request")
    add_security_options(p)
    add_parser_options(p)


def add_parser_options(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for reading tool calls and reasoning out of chat answers (names checked by serve, so a
    wrong one is a one-line error)."""
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto" (the default when a request has tools); needs --tool-call-parser',
    )
    p.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help=f"read tool calls out of chat answers: {', '.join(TOOL_CALL_PARSERS)}",
    )
    p.add_argument(
        "--reasoning-parser",
        metavar="NAME",
        help=f"split <think> reasoning into reasoning_content: {', '.join(REASONING_PARSERS)}",
    )
    p.add_argument(
        "--structured-outputs-in-reasoning",
        action="store_true",
        help="with --reasoning-parser, constrain the reasoning too (vLLM's enable_in_reasoning); by default "
        "a request's structured output holds once the reasoning has ended",
    )


def add_security_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        action="extend",
        nargs="+",
        metavar="KEY",
        help=f"/v1 requests need 'Authorization: Bearer KEY'; several: --api-key K1 K2, or repeat the flag "
        f"(default: the comma-separated ${API_KEY_ENV}, which keeps keys out of the process list)",
    )
    p.add_argument(
        "--metrics-api-key", action="extend", nargs="+", metavar="KEY", help="/metrics needs one of these"
    )
    p.add_argument(
        "--allowed-origins",
        action="extend",
        nargs="+",
        metavar="ORIGIN",
        help="enable CORS for these browser origins (e.g. https://app.example, or *); default: off",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=MAX_REQUEST_BYTES,
        help="larger request bodies get 413",
    )
    p.add_argument(
        "--max-tokens-per-request",
        type=int,
        default=MAX_TOKENS_PER_REQUEST,
        help="bound on n x prompts x max_tokens of one request",
    )
    p.add_argument(
        "--max-speculative-budget",
        type=int,
        default=MAX_SPECULATIVE_BUDGET,
        metavar="N",
        help="largest speculative.budget a request may ask for (a tree pads its whole batch's round)",
    )
