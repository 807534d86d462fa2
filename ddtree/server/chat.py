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

from ddtree.server.errors import invalid
from ddtree.server.protocol import ChatMessage

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
        out.append(entry)
    return out


def plain_prompt(messages: list[dict]) -> str:
    lines = [f"{ROLE_NAMES[m['role']]}: {m['content']}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The prompt for ``messages``: runs on the API side (a worker thread), never on the engine thread."""
    if tokenizer is None:
        raise invalid("this model has no tokenizer, so it cannot chat; use /v1/completions with token ids")
    if not getattr(tokenizer, "chat_template", None):
        return plain_prompt(messages)
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as exc:  # templates reject conversations they cannot render (roles, order)
        raise invalid(f"the chat template refused these messages: {exc}", "messages") from None
