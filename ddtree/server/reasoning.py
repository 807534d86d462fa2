"""Reasoning in a model's text (``--reasoning-parser``): what it thinks between ``<think>`` and
``</think>`` becomes ``reasoning_content``, the rest ``content``, as vLLM's parsers split it.

- ``deepseek_r1``: the chat template may open ``<think>`` in the prompt, so everything before ``</think>``
  is reasoning (a leading ``<think>`` is dropped); no ``</think>`` means it was all reasoning.
- ``qwen3``, ``glm45``: thinking can be switched off, so there is reasoning only when the output opens with
  ``<think>``; otherwise it is all content.
- ``kimi_k2``: as ``deepseek_r1``, and a tool-call section also ends the reasoning (it stays in content,
  for the tool parser).

An unclosed ``<think>`` is reasoning (the text was cut while thinking: vLLM's streamed view, which a whole
text must equal). ``ReasoningStream`` holds back a suffix that may begin a marker, so a marker's beginning
never leaks into either part. Light on purpose (no third-party import), like ``tool_parsers``.
"""

from __future__ import annotations

from ddtree.request.text import overlap
from ddtree.server.tool_parsers import KimiK2

THINK, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3", "kimi_k2", "glm45")


def grammar_start(tokenizer, prompt: str) -> tuple[int, ...]:
    """The token ids after which a reasoning answer's structured output holds (vLLM applies it once the
    reasoning has ended): ``</think>`` as the tokenizer writes it (one special token in reasoning models'
    vocabularies), or none when the rendered prompt has closed the thinking itself."""
    if prompt.rfind(END) > prompt.rfind(THINK):
        return ()
    return tuple(tokenizer.encode(END, add_special_tokens=False))


class ReasoningStream:
    """One answer's text as (reasoning, content) pieces: ``feed`` as it arrives, ``finish`` at its end."""

    def __init__(self, parser: str) -> None:
        self.optional = parser in ("qwen3", "glm45")  # no leading <think>: no reasoning
        self.ends = (END, KimiK2.start) if parser == "kimi_k2" else (END,)
        self._state = "start"  # until the text shows whether it opens with <think>
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        if self._state == "start":
            head = self._buffer.lstrip()
            if head.startswith(THINK):
                self._buffer, self._state = head[len(THINK) :], "reasoning"
            elif THINK.startswith(head):
                return "", ""  # it may still open with <think>
            else:
                self._state = "content" if self.optional else "reasoning"
        reasoning = ""
        if self._state == "reasoning":
            hits = [(at, marker) for marker in self.ends if (at := self._buffer.find(marker)) >= 0]
            if not hits:
                keep = len(self._buffer) - max(overlap(self._buffer, marker) for marker in self.ends)
                reasoning, self._buffer = self._buffer[:keep], self._buffer[keep:]
                return reasoning, ""
            at, marker = min(hits)
            reasoning, self._state = self._buffer[:at], "content"
            self._buffer = self._buffer[at + len(END) :] if marker == END else self._buffer[at:]
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        if self._state == "content" or (self._state == "start" and self.optional):
            return "", rest
        return rest, ""
