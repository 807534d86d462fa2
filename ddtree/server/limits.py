"""Limits on what one request may cost, each checked before the work it guards.

- :class:`BodySizeLimit` (ASGI middleware) refuses a body over ``max_request_bytes`` with 413: at once
  when its Content-Length says so, else as soon as the chunks read so far pass the limit. The body is
  never held beyond the limit, whatever the client sends.
- :func:`check_plan` runs on the event loop before a request takes a queue slot: prompts that cannot fit
  the context (text, chat messages included, by its length in characters, before any tokenizing; token
  ids by their count, before any id is checked) and requests whose choices could generate more than
  ``max_tokens_per_request`` tokens in all. (How many messages a chat may have is the request schema's
  bound, ``protocol.MAX_MESSAGES``, checked while parsing.)
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ddtree.errors import DDTreeError
from ddtree.request.params import check_budget
from ddtree.server.config import SERVER_BUDGET_LIMIT, Limits
from ddtree.server.errors import APIError, invalid
from ddtree.server.generation import COMPLETION_DEFAULT_MAX_TOKENS, Plan


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than this server accepts ({limit} bytes; --max-request-bytes)",
        code="request_too_large",
        headers={"Connection": "close"},
    )


class BodySizeLimit:
    """Reads the body ahead of the app, counting bytes, and answers 413 as soon as it passes ``limit``."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await too_large(self.limit).response()(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body was complete: nobody to answer
            body += message.get("body", b"")
            if len(body) > self.limit:
                await too_large(self.limit).response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body read ahead as one message, then whatever the client sends next."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


def longest_token_chars(tokenizer) -> int | None:
    """The most characters of text one token stands for (its vocabulary string's length, which for byte
    level BPE is its byte count, never fewer than its characters); None without a tokenizer."""
    if tokenizer is None:
        return None
    return max(map(len, tokenizer.get_vocab()), default=1) or 1


def check_plan(plan: Plan, context: int, token_chars: int | None, limits: Limits) -> None:
    """Raise the 400 for a request that cannot fit the context or asks for too much work."""
    if plan.options.budget is not None:
        try:
            check_budget(plan.options.budget, limits.max_speculative_budget, SERVER_BUDGET_LIMIT)
        except DDTreeError as exc:
            raise invalid(str(exc), "speculative.budget", "budget_exceeds_server_limit") from None
    chat = plan.messages is not None
    if chat:
        chars = sum(len(m["content"]) for m in plan.messages)
        _check_text(chars, context, token_chars, "messages")
        prompts = 1
    else:
        for prompt in plan.prompts:
            if isinstance(prompt, str):
                _check_text(len(prompt), context, token_chars, "prompt")
            elif len(prompt) >= context:
                raise _context_exceeded(f"the prompt has {len(prompt)} tokens", context, "prompt")
        prompts = len(plan.prompts)
    if plan.max_tokens is not None:
        per_choice = min(plan.max_tokens, context - 1)  # more than fits is the context check's to refuse
    else:
        per_choice = context - 1 if chat else COMPLETION_DEFAULT_MAX_TOKENS
    work = plan.n * prompts * per_choice
    if work > limits.max_tokens_per_request:
        unset = "" if plan.max_tokens is not None else " (unset: the rest of the context)"
        raise invalid(
            f"this request could generate {work} tokens (n={plan.n} x {prompts} prompt(s) x max_tokens "
            f"{per_choice}{unset}); this server allows {limits.max_tokens_per_request} per request",
            "max_tokens",
            "max_tokens_per_request_exceeded",
        )


def _check_text(chars: int, context: int, token_chars: int | None, param: str) -> None:
    """Text too long to fit in ``context`` tokens even if every token were the longest one."""
    if token_chars is not None and chars > context * token_chars:
        what = "the prompt has" if param == "prompt" else "the messages have"
        raise _context_exceeded(
            f"{what} {chars} characters, more than {context} tokens of at most {token_chars} characters",
            context,
            param,
        )


def _context_exceeded(what: str, context: int, param: str) -> APIError:
    return invalid(
        f"{what}; the model's context holds {context} tokens (including the answer)",
        param,
        "context_length_exceeded",
    )
