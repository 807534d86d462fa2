"""Chat messages -> one prompt string: the tokenizer's chat template, or a plain fallback without one.

The fallback (for tokenizers that ship no template, like base models) is one line per message and an
open assistant turn::

    System: You are terse.
    User: Hi
    Assistant: Hello.
    User: What is 2 + 2?
    Assistant:

A base model may continue with ``\\nUser:``; pass ``stop: ["\\nUser:"]`` to end the turn there. A
``tool`` message (a result the client sends back) is a ``Tool:`` line.
"""

from __future__ import annotations

import logging
import re

from ddtree.server.errors import invalid
from ddtree.server.protocol import ChatMessage

log = logging.getLogger("ddtree.server")
# a message's fields a template may or may not read: given to one that mentions them, else dropped
TEMPLATE_OPTIONAL = ("reasoning_content", "reasoning")
IGNORED_MESSAGE_FIELDS = ("refusal", "audio", "annotations", "function_call")
_logged: set[str] = set()  # the fields dropped so far, logged once per process

ROLE_NAMES = {
    "system": "System",
    "developer": "System",
    "user": "User",
    "assistant": "Assistant",
    "tool": "Tool",
}


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as a template expects them: text content (parts joined), plus a tool message's
    ``tool_call_id`` and an assistant's earlier ``tool_calls``."""
    out = []
    for i, m in enumerate(messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            if "content" not in m.model_fields_set:  # omitted: OpenAI's missing parameter
                param = f"messages[{i}].content"
                raise invalid(f"{param} is required", param, "missing_required_parameter")
            raise invalid(
                "content may be null only in an assistant message with tool_calls", f"messages[{i}].content"
            )
        if m.tool_calls is not None and m.role != "assistant":
            raise invalid("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
        if m.content is None:
            content = ""
        else:
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        entry: dict = {"role": m.role, "content": content}
        for key in ("name", "tool_call_id", "tool_calls"):
            if getattr(m, key) is not None:
                entry[key] = getattr(m, key)
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:  # both names, as the server returns them: a template reads either
            entry["reasoning_content"] = entry["reasoning"] = reasoning
        for key in IGNORED_MESSAGE_FIELDS:
            if getattr(m, key) is not None:
                _log_once(key, "the server does not use it")
        out.append(entry)
    return out


def _log_once(key: str, why: str) -> None:
    if key not in _logged:
        _logged.add(key)
        log.warning("ignoring the message field %r: %s (logged once)", key, why)


def template_fields(template: object, messages: list[dict]) -> list[dict]:
    """``messages`` without the optional fields (``TEMPLATE_OPTIONAL``) that ``template`` (its source; None
    for the plain fallback) never mentions: each dropped field is logged once."""
    source = template if isinstance(template, str) else str(template or "")
    unread = [key for key in TEMPLATE_OPTIONAL if not re.search(rf"\b{key}\b", source)]
    out = []
    for m in messages:
        dropped = [key for key in unread if key in m]
        if len(dropped) == len(TEMPLATE_OPTIONAL):  # one of the two names is enough
            _log_once("reasoning_content", "the chat template does not read it")
        out.append({k: v for k, v in m.items() if k not in dropped})
    return out


# apply_chat_template's own arguments: chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def plain_prompt(messages: list[dict], add_generation_prompt: bool = True) -> str:
    lines = [f"{ROLE_NAMES[m['role']]}: {m['content']}" for m in messages]
    return "\n".join([*lines, "Assistant:"] if add_generation_prompt else lines)


def render_chat(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt for ``messages`` (and ``tools``, and the request's ``chat_template_kwargs``, which the
    plain fallback has no place for): runs on the API side (a worker thread), never on the engine thread."""
    if tokenizer is None:
        raise invalid("this model has no tokenizer, so it cannot chat; use /v1/completions with token ids")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {}))
    if reserved:
        raise invalid(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    template = getattr(tokenizer, "chat_template", None)
    messages = template_fields(template, messages)
    if not template:
        return plain_prompt(messages, add_generation_prompt)
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )
    except TemplateError as exc:  # templates reject conversations they cannot render (roles, order)
        raise invalid(f"the chat template refused these messages: {exc}", "messages") from None
