"""Tool-call and reasoning parsers on model outputs in each format: the whole text's reading, and the same
text streamed split at every character boundary (and a character at a time), which must put together to
exactly the whole reading, never showing a marker's beginning as content."""

from __future__ import annotations

import json

import pytest

from ddtree.server.reasoning import REASONING_PARSERS, ReasoningStream
from ddtree.server.responses import MessageParser, MessageParsing
from ddtree.server.tool_parsers import (
    FORMATS,
    TOOL_CALL_PARSERS,
    NamedCallStream,
    RequiredCallsStream,
    ToolCallStream,
    required_schema,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array"},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
WEATHER = '{"city": "Paris", "days": 3}'
KIMI = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
    "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
)
# (parser, model output, content, [(name, arguments)])
CASES = [
    ("hermes", 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check.", [("get_weather", WEATHER), ("get_time", "{}")]),
    ("hermes", '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>', None,
     [("get_weather", '{"city": "Rome"}')]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", "{}")]),  # cut short
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "}"}, "id": 7}</tool_call>', None,
     [("get_time", '{"zone": "}"}')]),
    ("hermes", "a < b, and <tool_call>not json</tool_call> stays text",
     "a < b, and <tool_call>not json</tool_call> stays text", []),
    ("hermes", "No call here: <tool_ca", "No call here: <tool_ca", []),
    ("qwen3_coder", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n"
     "</parameter>\n</function>\n</tool_call>",
     "Sure.", [("get_weather", '{"city": "Paris", "days": 3, "metric": true, "hours": [1, 2]}')]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n3 rue <b>\n</parameter>\n"
     "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     None, [("get_weather", '{"city": "3 rue <b>"}'), ("get_time", "{}")]),
    ("kimi_k2", "I'll look it up." + KIMI, "I'll look it up.",
     [("get_weather", WEATHER), ("get_time", "{}")]),
    ("glm45", "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>Done.",
     "Checking.Done.", [("get_weather", WEATHER)]),
    ("glm45", "<tool_call>get_time\n</tool_call>", None, [("get_time", "{}")]),
]  # fmt: skip


def run(stream, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list]:
    """Feed ``pieces``: (content or None, [(name, arguments)], every delta), checking the deltas' shape."""
    content, deltas = "", []
    for piece in pieces:
        text, more = stream.feed(piece)
        content, deltas = content + text, deltas + more
    text, more = stream.finish()
    content, deltas = content + text, deltas + more
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.index not in calls:  # a call's first delta: its id and name, indices in order
            assert d.id and d.name and d.index == len(calls), d
            calls[d.index] = [d.name, ""]
        else:
            assert d.id is None and d.name is None and d.arguments, d
        calls[d.index][1] += d.arguments
    return content or None, [tuple(c) for c in calls.values()], deltas


def splits(text: str) -> list[list[str]]:
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize(("parser", "output", "content", "calls"), CASES)
def test_a_tool_parser_reads_the_whole_text_and_every_split_of_it_alike(parser, output, content, calls):
    fmt = FORMATS[parser](TOOLS)
    whole = run(ToolCallStream(fmt), [output])
    assert whole[:2] == (content, calls)
    for pieces in splits(output):
        assert run(ToolCallStream(fmt), pieces)[:2] == whole[:2], pieces
    if parser == "kimi_k2":
        assert [d.id for d in whole[2] if d.id] == ["functions.get_weather:0", "functions.get_time:1"]
    else:
        assert all(d.id.startswith("chatcmpl-tool-") for d in whole[2] if d.id)


def test_streamed_arguments_come_in_fragments_where_the_format_allows():
    """qwen3_coder, glm45: a parameter at a time; hermes, kimi_k2: the model's JSON text as it comes."""
    for parser in TOOL_CALL_PARSERS:
        output = next(o for p, o, _, calls in CASES if p == parser and calls and calls[0][0] == "get_weather")
        deltas = run(ToolCallStream(FORMATS[parser](TOOLS)), list(output))[2]
        first = [d for d in deltas if d.index == 0]
        assert first[0].name == "get_weather" and len(first) > 2, parser


def test_every_parser_leaves_a_text_without_calls_as_it_is():
    text = "Plain answer, with < and <| and a trailing space "
    for parser in TOOL_CALL_PARSERS:
        for pieces in splits(text):
            assert run(ToolCallStream(FORMATS[parser](TOOLS)), pieces)[:2] == (text, [])


def test_forced_tool_choices_read_the_grammars_json():
    named = run(NamedCallStream("get_weather"), ['{"city": ', '"Paris"}'])
    assert named[:2] == (None, [("get_weather", '{"city": "Paris"}')]) and len(named[2]) == 2
    output = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    )
    for pieces in splits(output):
        got = run(RequiredCallsStream(), pieces)[:2]
        assert got == (None, [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")])
    assert len(run(RequiredCallsStream(), list(output))[2]) > 4  # the arguments stream as they come
    assert run(RequiredCallsStream(), ['[{"name": "get_t'])[:2] == ('[{"name": "get_t', [])  # cut short
    assert run(RequiredCallsStream(), ['[{"name": "get_time", "parameters": {"zo'])[:2] == (
        None,
        [("get_time", '{"zo')],
    )


def test_the_required_schema_is_an_array_of_named_calls_with_their_parameters():
    parameters = {"$defs": {"D": {"type": "integer"}}, "properties": {"d": {"$ref": "#/$defs/D"}}}
    defs_tool = {"function": {"name": "f", "parameters": parameters}}
    schema = required_schema([*TOOLS, defs_tool], parallel=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"]["enum"] for o in options] == [["get_weather"], ["get_time"], ["f"]]
    assert options[0]["properties"]["parameters"] == TOOLS[0]["function"]["parameters"]
    assert (
        schema["$defs"] == {"D": {"type": "integer"}}
        and "$defs" not in options[2]["properties"]["parameters"]
    )
    assert "maxItems" not in required_schema(TOOLS)
    json.dumps(schema)


# (parser, model output, reasoning, content)
REASONING = [
    ("deepseek_r1", "<think>\nStep 1: 2 + 2.\n</think>\n\nIt is 4.", "\nStep 1: 2 + 2.\n", "\n\nIt is 4."),
    ("deepseek_r1", "Step 1: 2 + 2.</think>It is 4.", "Step 1: 2 + 2.", "It is 4."),  # <think> in the prompt
    ("deepseek_r1", "Still thinking <", "Still thinking <", None),  # cut while thinking
    ("qwen3", "<think>a < b</think>\n\nSo b.", "a < b", "\n\nSo b."),
    ("qwen3", "No thinking here </think>", None, "No thinking here </think>"),  # thinking switched off
    ("qwen3", "<thin", None, "<thin"),
    ("glm45", "\n<think>Hmm.</think>Answer.", "Hmm.", "Answer."),
    ("glm45", "Answer.", None, "Answer."),
    ("kimi_k2", "<think>Need the weather.</think>Let me look.", "Need the weather.", "Let me look."),
    ("kimi_k2", "Need the weather." + KIMI, "Need the weather.", KIMI),  # a tool section ends it
]


def run_reasoning(parser: str, pieces: list[str]) -> tuple[str | None, str | None]:
    stream = ReasoningStream(parser)
    parts = [stream.feed(p) for p in pieces] + [stream.finish()]
    return "".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None


@pytest.mark.parametrize(("parser", "output", "reasoning", "content"), REASONING)
def test_a_reasoning_parser_splits_the_whole_text_and_every_split_of_it_alike(
    parser, output, reasoning, content
):
    assert run_reasoning(parser, [output]) == (reasoning, content)
    for pieces in splits(output):
        assert run_reasoning(parser, pieces) == (reasoning, content), pieces


def test_every_parser_is_tested():
    assert {p for p, *_ in REASONING} == set(REASONING_PARSERS)
    assert {p for p, *_ in CASES} == set(TOOL_CALL_PARSERS)


@pytest.mark.parametrize(
    ("reasoning", "tools", "output"),
    [
        ("qwen3", "hermes", '<think>Weather, then.</think>\n\nOK.\n<tool_call>\n{"name": "get_weather", '
                             '"arguments": {"city": "Paris", "days": 3}}\n</tool_call>'),
        ("kimi_k2", "kimi_k2", "<think>Weather, then.</think>OK."
         + KIMI[: KIMI.index("<|tool_call_begin|>functions.get_time")] + "<|tool_calls_section_end|>"),
    ],
)  # fmt: skip
def test_reasoning_comes_out_first_and_tool_calls_are_read_in_the_rest(reasoning, tools, output):
    parsing = MessageParsing(reasoning, tools, tuple(TOOLS))
    for pieces in splits(output):
        parser = MessageParser(parsing)
        deltas = [parser.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert "".join(d.reasoning for d in deltas) == "Weather, then."
        assert "".join(d.content for d in deltas) == ("\n\nOK." if tools == "hermes" else "OK.")
        calls = [c for d in deltas for c in d.tool_calls]
        assert calls[0].name == "get_weather" and "".join(c.arguments for c in calls) == WEATHER
