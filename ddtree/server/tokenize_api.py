"""vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``: what a client needs to count and
read tokens as this server does (a chat is rendered exactly as ``/v1/chat/completions`` renders it).

They need the same API key as ``/v1`` (``auth.py``); the tokenizer runs in a worker thread, never on the
engine thread.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

import ddtree
from ddtree.server.body import LargeBodyRoute
from ddtree.server.chat import message_dicts, render_chat
from ddtree.server.errors import invalid
from ddtree.server.openai_api import ERRORS, check_model
from ddtree.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    Version,
)

router = APIRouter(tags=["tokens"], route_class=LargeBodyRoute)


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """A ``prompt``'s token ids, or the ids of ``messages`` (with ``tools``) as chat renders them."""
    check_model(request, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise invalid("give exactly one of prompt and messages", "prompt")
    model = request.app.state.ddtree.model()  # 503 while loading
    tokenizer = model.engine.tokenizer
    if tokenizer is None:
        raise invalid("this model has no tokenizer")

    def encode() -> list[int]:
        if body.prompt is not None:
            text, special = body.prompt, body.add_special_tokens is not False
        else:
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
            messages, kwargs = message_dicts(body.messages), body.chat_template_kwargs
            text = render_chat(tokenizer, messages, tools, kwargs, body.add_generation_prompt)
            special = bool(body.add_special_tokens)  # a rendered template carries its own
        return tokenizer.encode(text, add_special_tokens=special)

    tokens = await asyncio.to_thread(encode)
    return TokenizeResponse(count=len(tokens), max_model_len=model.max_positions, tokens=tokens)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """The text of token ids, special tokens included."""
    check_model(request, body.model)
    tokenizer = request.app.state.ddtree.model().engine.tokenizer
    if tokenizer is None:
        raise invalid("this model has no tokenizer")
    size = len(tokenizer)
    if any(not 0 <= t < size for t in body.tokens):
        raise invalid(f"token ids must be in [0, {size})", "tokens")
    return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens))


@router.get("/version", response_model=Version)
def version() -> Version:
    return Version(version=ddtree.__version__)
