"""Tool calls in a model's text, in vLLM's formats (``--tool-call-parser``): ``hermes``, ``qwen3_coder``,
``kimi_k2`` and ``glm45``; and the calls of ``tool_choice: "required"`` or a named function, whose output
the server's grammar makes JSON.

Each format wraps its calls in blocks between a start and an end marker. ``ToolCallStream`` reads the text
as it arrives: text outside the blocks is content (a suffix that may begin a marker is held until it can
tell, so no marker's beginning ever leaks out, and whitespace next to a block is dropped); a block's calls
come out as OpenAI's ``tool_calls`` deltas: index, id, type and name once the name is known, then argument
fragments as far as the format allows (whole JSON arguments, as ``hermes`` writes them, once the block
ends). A whole text is the same stream fed at once, so a non-streamed answer is exactly the streamed one put
together. A block that does not parse stays content, as in vLLM.

Light on purpose (no third-party import): ``ddtree serve``'s flags list the parsers' names from here.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ddtree.request.text import overlap


@dataclass
class PartialCall:
    """A call as far as a block's text shows it; each later look at a longer text extends ``arguments``."""

    name: str | None  # None until the whole name has been read
    arguments: str  # JSON text so far
    id: str | None = None  # the format's own id (kimi_k2's ``functions.NAME:IDX``); else the server makes one


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass
class ToolCallDelta:
    """One ``delta.tool_calls`` entry: the first of a call carries its id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def call_id(name: str = "", index: int = 0) -> str:
    """vLLM's id of a call whose format writes none."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class Format:
    """A tool-call format: its block markers and how a block's text reads as calls."""

    start: str
    end: str

    @staticmethod
    def call_id(name: str, index: int) -> str:
        """The id of call ``index`` (counted over the conversation) when the text names none: the format's
        own, so that every ``tool_choice`` gives the ids the model reads back in its history."""
        return call_id()

    def __init__(self, tools: list[dict]) -> None:
        # function -> parameter -> JSON schema type, for formats that write values as bare text
        self.types = {
            tool["function"]["name"]: {
                key: prop.get("type") if isinstance(prop, dict) else None
                for key, prop in ((tool["function"].get("parameters") or {}).get("properties") or {}).items()
            }
            for tool in tools
        }

    def scan(self, block: str, complete: bool) -> list[PartialCall]:
        """The calls in ``block`` so far (``complete``: the block has ended); a complete block that is not
        a call raises ValueError."""
        raise NotImplementedError

    def value(self, function: str, key: str, text: str) -> object:
        """A parameter written as bare text, as its schema types it: strings stay text, anything else is
        read as JSON when it is JSON (numbers, booleans, null, objects, arrays)."""
        kind = self.types.get(function, {}).get(key)
        if kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind):
            return text
        try:
            return json.loads(text)
        except ValueError:
            return text


def _object_text(pairs: list[tuple[str, object]], finished: bool) -> str:
    """``json.dumps`` of the object ``pairs`` make, written a pair at a time: a prefix of it until
    ``finished`` (nothing before the first pair)."""
    items = ", ".join(
        f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in pairs
    )
    text = "{" + items if pairs else ""
    return (text or "{") + "}" if finished else text


def json_end(text: str, start: int) -> int | None:
    """Where the JSON value that begins at ``text[start]`` ends, or None while more text may extend it (a
    scan of strings and brackets: the value's own text streams as it comes, whatever follows it)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif depth == 0 and i > start and ch in ",}] \t\r\n":
            return i  # a number or literal has ended
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1
    return None


def _quoted(text: str) -> str | None:
    """A JSON string's content (without its quotes) decoded, or None when it is not one."""
    try:
        return json.loads(f'"{text}"')
    except ValueError:
        return None


_STRING = r'"((?:[^"\\]|\\.)*)"'  # a complete JSON string


class Hermes(Format):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Qwen3, Hermes).

    Written name first, as these models do, the arguments stream as the model's own JSON text; otherwise
    they come whole, re-serialised, once the call ends."""

    start, end = "<tool_call>", "</tool_call>"
    _head = re.compile(r'\s*\{\s*"name"\s*:\s*' + _STRING)
    _arguments = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')

    def scan(self, block: str, complete: bool) -> list[PartialCall]:
        head = self._head.match(block)
        after = self._arguments.match(block, head.end()) if head else None
        at = after.end() if after else len(block)
        arguments = block[at : json_end(block, at) or len(block)]
        if not complete:
            name = _quoted(head.group(1)) if head else None
            return [] if name is None else [PartialCall(name, arguments)]
        call = json.loads(block)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError("a hermes tool call is an object with a name")
        if after is None:
            value = call.get("arguments", call.get("parameters", {}))
            arguments = json.dumps(value, ensure_ascii=False)
        return [PartialCall(call["name"], arguments)]


class Qwen3Coder(Format):
    """``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>``."""

    start, end = "<tool_call>", "</tool_call>"
    _function = re.compile(r"\s*<function=([^>\n]+)>")
    _parameter = re.compile(r"<parameter=([^>\n]+)>")

    def scan(self, block: str, complete: bool) -> list[PartialCall]:
        header = self._function.match(block)
        if header is None:
            if complete:
                raise ValueError("a qwen3_coder tool call starts with <function=NAME>")
            return []
        name = header.group(1).strip()
        body, closed, _ = block[header.end() :].partition("</function>")
        finished = bool(closed) or complete
        parts = self._parameter.split(body)  # [before, key, raw value, key, raw value, ...]
        pairs = []
        for i in range(1, len(parts), 2):
            raw = parts[i + 1]
            last = i + 2 >= len(parts)
            if last and "</parameter>" not in raw and not finished:
                break  # the value may go on
            text = raw.split("</parameter>")[0].removeprefix("\n").removesuffix("\n")
            pairs.append((parts[i].strip(), self.value(name, parts[i].strip(), text)))
        return [PartialCall(name, _object_text(pairs, finished))]


class Glm45(Format):
    """``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>value</arg_value>\\n</tool_call>`` (GLM-4.5,
    GLM-4.6)."""

    start, end = "<tool_call>", "</tool_call>"
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def scan(self, block: str, complete: bool) -> list[PartialCall]:
        text = block.lstrip()
        ends = [i for i in (text.find("\n"), text.find("<arg_key>")) if i >= 0]
        if not ends and not complete:
            return []  # the name may go on
        name = text[: min(ends, default=len(text))].strip()
        if not name:
            if complete:
                raise ValueError("a glm45 tool call starts with its function's name")
            return []
        pairs = [
            (key.strip(), self.value(name, key.strip(), value))
            for key, value in self._pair.findall(text[len(name) :])
        ]
        return [PartialCall(name, _object_text(pairs, complete))]


class KimiK2(Format):
    """``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}
    <|tool_call_end|>...<|tool_calls_section_end|>``: one section, any number of calls; the arguments are the
    model's own JSON text, and ``functions.NAME:IDX`` is the call's id."""

    start, end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    call_begin, call_end = "<|tool_call_begin|>", "<|tool_call_end|>"
    argument_begin = "<|tool_call_argument_begin|>"

    @staticmethod
    def call_id(name: str, index: int) -> str:
        return f"functions.{name}:{index}"

    def scan(self, block: str, complete: bool) -> list[PartialCall]:
        calls = []
        for part in block.split(self.call_begin)[1:]:
            head, begun, rest = part.partition(self.argument_begin)
            ident = head.strip()
            name = ident.rsplit(":", 1)[0].removeprefix("functions.") if begun else ""
            if not name:
                if complete:
                    raise ValueError("a kimi_k2 tool call is functions.NAME:IDX, then its arguments")
                break
            raw, closed, _ = rest.partition(self.call_end)
            if not (closed or complete):
                raw = raw[: len(raw) - overlap(raw, self.call_end)]
            calls.append(PartialCall(name, raw.strip(), ident))
            if not (closed or complete):
                break  # the arguments may go on
        return calls


FORMATS: dict[str, type[Format]] = {
    "hermes": Hermes,
    "qwen3_coder": Qwen3Coder,
    "kimi_k2": KimiK2,
    "glm45": Glm45,
}
TOOL_CALL_PARSERS = tuple(FORMATS)


class CallStream:
    """What a chat answer's (post-reasoning) text holds, read as it arrives: ``feed`` and, once the text
    has ended, ``finish`` each return (content, tool_calls deltas); ``calls`` holds the calls so far.
    ``complete``, once finished: the whole text was the calls, each one ended (a grammar's JSON that
    parses); a text cut short is not, whatever its calls' arguments look like. Calls get ids from ``ids``
    (a format's ``call_id``), counted from ``first`` (the calls earlier in the conversation)."""

    def __init__(self, ids=call_id, first: int = 0) -> None:
        self.calls: list[ToolCall] = []
        self.ids = ids
        self.first = first
        self.complete = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def _extend(self, index: int, arguments: str, out: list[ToolCallDelta]) -> None:
        """Send what ``arguments`` adds to call ``index``'s (merged into that call's last delta); nothing
        when it does not extend what was sent (a call written against its format's habits)."""
        call = self.calls[index]
        new = arguments[len(call.arguments) :]
        if not new or not arguments.startswith(call.arguments):
            return
        call.arguments += new
        if out and out[-1].index == index:
            out[-1].arguments += new
        else:
            out.append(ToolCallDelta(index, arguments=new))

    def _begin(self, name: str, ident: str | None, out: list[ToolCallDelta]) -> int:
        self.calls.append(ToolCall(ident or self.ids(name, self.first + len(self.calls)), name, ""))
        index = len(self.calls) - 1
        out.append(ToolCallDelta(index, self.calls[index].id, name))
        return index


class ToolCallStream(CallStream):
    """Content and calls of a ``Format`` (``tool_choice: "auto"`` with ``--tool-call-parser``)."""

    def __init__(self, fmt: Format, first: int = 0) -> None:
        super().__init__(fmt.call_id, first)
        self.fmt = fmt
        self._buffer = ""  # held content, or the open block's text so far
        self._in_block = False
        self._after_block = False  # whitespace right after a block is dropped
        self._gap = ""  # the whitespace dropped before the open block (back if it holds no call)
        self._block_calls: list[int] = []  # indices of the open block's calls begun so far

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buffer += text
        content: list[str] = []
        out: list[ToolCallDelta] = []
        start, end = self.fmt.start, self.fmt.end
        while self._buffer:
            if self._in_block:
                at = self._buffer.find(end)
                if at < 0:  # a scan never sees the start of the end marker
                    seen = self._buffer[: len(self._buffer) - overlap(self._buffer, end)]
                    self._send(self.fmt.scan(seen, complete=False), out)
                    break
                content.append(self._close(self._buffer[:at], end, out))
                self._buffer = self._buffer[at + len(end) :]
                continue
            if self._after_block:
                self._buffer = self._buffer.lstrip()
                self._after_block = not self._buffer
                continue
            at = self._buffer.find(start)
            if at >= 0:
                before = self._buffer[:at].rstrip()
                content.append(before)
                self._gap = self._buffer[len(before) : at]
                self._buffer = self._buffer[at + len(start) :]
                self._in_block, self._block_calls = True, []
                continue
            keep = len(self._buffer) - overlap(self._buffer, start)
            keep = len(self._buffer[:keep].rstrip())  # whitespace waits: a block may follow it
            content.append(self._buffer[:keep])
            self._buffer = self._buffer[keep:]
            break
        return "".join(content), out

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        rest, self._buffer = self._buffer, ""
        out: list[ToolCallDelta] = []
        if self._in_block:
            return self._close(rest, "", out), out
        return rest, out

    def _close(self, block: str, end: str, out: list[ToolCallDelta]) -> str:
        """End the open block: its last calls' deltas; its text back as content (as it was, whitespace
        around it included) if it holds no call."""
        self._in_block = False
        try:
            calls = self.fmt.scan(block, complete=True)
        except ValueError:  # a block cut short: its calls as far as they go, none dropped unsaid
            calls = self.fmt.scan(block, complete=False) if self._block_calls else []
        self._after_block = bool(calls or self._block_calls)
        if not self._after_block:
            return self._gap + self.fmt.start + block + end
        self._send(calls, out)
        return ""

    def _send(self, calls: list[PartialCall], out: list[ToolCallDelta]) -> None:
        for i, call in enumerate(calls):
            if call.name is None:
                break
            if i == len(self._block_calls):
                self._block_calls.append(self._begin(call.name, call.id, out))
            self._extend(self._block_calls[i], call.arguments, out)


class NamedCallStream(CallStream):
    """A named ``tool_choice``: the grammar made the whole text that function's arguments."""

    def __init__(self, name: str, ids=call_id, first: int = 0) -> None:
        super().__init__(ids, first)
        self.name = name

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        out: list[ToolCallDelta] = []
        if not self.calls:
            self._begin(self.name, None, out)
        self._extend(0, self.calls[0].arguments + text, out)
        return "", out

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        done = self.feed("")
        self.complete = parses(self.calls[0].arguments)
        return done


def parses(text: str) -> bool:
    """``text`` is one whole JSON value."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class RequiredCallsStream(CallStream):
    """``tool_choice: "required"``: the grammar makes the text a JSON array of ``{"name", "parameters"}``
    in that order (``required_schema``); each call begins once its name is complete and its arguments
    stream as written. A text cut short before any name stays content."""

    _item = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*' + _STRING + r'\s*,\s*"parameters"\s*:\s*')
    _item_end = re.compile(r"\s*\}")

    def __init__(self, ids=call_id, first: int = 0) -> None:
        super().__init__(ids, first)
        self._text = ""
        self._done = 0  # where the next item begins
        self._open: int | None = None  # the call of the item being written

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._text += text
        out: list[ToolCallDelta] = []
        while (item := self._item.match(self._text, self._done)) is not None:
            name = _quoted(item.group(1))
            if name is None:
                break
            if self._open is None:
                self._open = self._begin(name, None, out)
            end = json_end(self._text, item.end())
            self._extend(self._open, self._text[item.end() : end or len(self._text)], out)
            close = self._item_end.match(self._text, end) if end is not None else None
            if close is None:
                break
            self._done, self._open = close.end(), None
        return "", out

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        self.complete = bool(self.calls) and parses(self._text)
        return ("" if self.calls else self._text), []


def _lift_defs(schema: dict | None, defs: dict) -> dict:
    """A parameters schema without its ``$defs``, which go to ``defs`` (the combined schema's top level,
    where its ``#/$defs/...`` references point)."""
    schema = dict(schema or {"type": "object", "properties": {}})
    defs.update(schema.pop("$defs", {}))
    return schema


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """The JSON schema of ``tool_choice: "required"`` (vLLM's): an array of one call or more (one only
    without ``parallel_tool_calls``), each ``{"name": a tool's name, "parameters": its arguments}``."""
    defs: dict = {}
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool["function"]["name"]]},
                "parameters": _lift_defs(tool["function"].get("parameters"), defs),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(tool: dict) -> dict:
    """The JSON schema of a named ``tool_choice``: that function's arguments (any object without one)."""
    return tool["function"].get("parameters") or {"type": "object"}
