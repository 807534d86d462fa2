"""One EngineConfig for every entry point (issue 35 item 2): each option's default, check and message live
in ``ddtree.config``; the commands' engine flags are generated from its fields and read back from them."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from ddtree.cli import build_parser
from ddtree.config import FIELD_FLAGS, EngineConfig
from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from tests.conftest import tiny_drafter, tiny_target

NO_FLAG = {  # fields set from Python only, and why
    "auto_max_budget": "a tuning bound of budget 'auto', not a deployment choice",
    "prefill_gap_rounds": "scheduling by measured time; tests switch it off for determinism",
    "fixed_shapes": "padding without compiling: tests and debugging; --compile implies it",
    "profile": "set by generate's --stats and by bench",
    "draft_dtype": "a torch dtype for a drafter kept apart from the target's (training, experiments)",
}
LOAD = {"target", "drafter", "device", "dtype", "trust_remote_code", "threads"}  # from_pretrained's, threads
COMMAND_OWN = {  # what each engine-running command adds beside the engine and its loading
    "generate": {"prompt", "prompt_file", "temperature", "top_k", "top_p", "min_p", "seed", "max_new_tokens",
                 "stop", "stats", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens",
                 "bad_word", "chat"},
    "serve": None,  # the server's flags: ddtree.server.options
    "bench": None,  # the benchmark's grid: ddtree.bench.cli.add_bench_options
}  # fmt: skip


def subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: action.choices[name] for name in COMMAND_OWN}


def dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions if a.dest != "help"}


def test_every_engine_flag_is_a_config_field_and_every_field_a_flag():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(FIELD_FLAGS) | set(NO_FLAG) == fields and not set(FIELD_FLAGS) & set(NO_FLAG)
    parsers = subparsers()
    flagged = set()
    for name, parser in parsers.items():
        engine_dests = dests(parser) & fields
        flagged |= engine_dests
        for action in parser._actions:  # each flag that sets a field is the field's own (or an alias)
            if action.dest in fields:
                assert FIELD_FLAGS[action.dest] in action.option_strings or action.help == argparse.SUPPRESS
        own = COMMAND_OWN[name]
        if own is not None:
            assert dests(parser) - fields - LOAD == own
    assert flagged == set(FIELD_FLAGS)  # and back: every flagged field is reachable from a command
    signature = inspect.signature(Engine.from_pretrained).parameters
    assert LOAD - {"target", "drafter", "threads"} <= set(signature)


def test_flags_read_back_into_the_config():
    argv = ["serve", "--budget", "32", "--draft-topk", "4", "--max-num-seqs", "8", "--kv-cache-memory",
            "1GiB", "--no-enable-prefix-caching", "--compile", "--node-buckets", "1,17,33",
            "--attention-backend", "flex", "-tp", "1"]  # fmt: skip
    config = EngineConfig.from_args(build_parser().parse_args(argv))
    assert config == EngineConfig(
        budget=32, topk=4, max_num_seqs=8, kv_cache_memory=1 << 30, enable_prefix_caching=False,
        compile=True, node_buckets=(1, 17, 33), attention="flex",
    )  # fmt: skip
    defaults = EngineConfig.from_args(build_parser().parse_args(["serve"]))
    assert defaults == EngineConfig()  # the flags' defaults are the fields'


@pytest.mark.parametrize(
    ("options", "keyword", "flag"),
    [
        ({"block_size": 0}, "block_size must be", "--block-size must be"),
        ({"node_buckets": (17,)}, "node_buckets needs fixed shapes", "--node-buckets needs --compile"),
        (
            {"attention": "flex"},
            "attention='flex' needs compile=True",
            "--attention-backend flex needs --compile",
        ),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must", "--gpu-memory-utilization must"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1", "--max-num-seqs must be an integer"),
    ],
)
def test_one_rule_one_message_spelt_as_the_user_wrote_it(options, keyword, flag):
    with pytest.raises(DDTreeError, match=keyword):
        EngineConfig(**options)
    with pytest.raises(DDTreeError, match=flag):
        EngineConfig(**options, from_flags=True)


def test_keywords_and_a_config_build_the_same_engine():
    target = tiny_target()
    drafter = tiny_drafter(target)
    config = EngineConfig(budget=8, max_num_seqs=3, max_model_len=64)
    by_config = Engine(target, drafter, None, config)
    by_keywords = Engine(target, drafter, max_batch_size=3, budget=8, max_model_len=64)
    assert by_config.config == by_keywords.config == config
    assert Engine(target, drafter, None, config, budget=4).config == dataclasses.replace(config, budget=4)
    with pytest.raises(DDTreeError, match="disagree"):
        Engine(target, drafter, max_num_seqs=2, max_batch_size=3)
    with pytest.raises(TypeError, match="unknown engine option"):
        Engine(target, drafter, max_batch=3)
