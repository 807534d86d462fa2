"""Stop strings end generation exactly where they appear, even inside one accepted block, and never leak."""

from __future__ import annotations

import pytest

from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.request.params import SamplingParams
from tests.conftest import tiny_drafter, tiny_target, tiny_tokenizer
from tests.test_engine_greedy import round_spans

NEW = 40


@pytest.fixture(scope="module")
def engine() -> Engine:
    tokenizer = tiny_tokenizer()
    target = tiny_target(vocab=len(tokenizer))
    drafter = tiny_drafter(target)
    drafter.mask_token_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    return Engine(target, drafter, tokenizer, method="ddtree", budget=256)


def completing_token(engine: Engine, ids: list[int], stop: str) -> int:
    """How many tokens it takes for the decoded text to contain ``stop``."""
    return next(n for n in range(1, len(ids) + 1) if stop in engine.tokenizer.decode(ids[:n]))


def test_stop_string_cuts_text_and_tokens_where_it_first_appears(engine):
    prompt = "def fib"
    full = engine.generate(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    spans = round_spans(full)
    inside_block = 0
    for begin in range(2, len(full.text) - 3, 3):
        stop = full.text[begin : begin + 3]
        cut = full.text.index(stop)
        params = SamplingParams(max_new_tokens=NEW, stop=(stop,), ignore_eos=True)
        result = engine.generate(prompt, params)
        assert result.text == full.text[:cut]
        assert result.finish_reason == "stop"
        n = completing_token(engine, full.token_ids, stop)
        assert result.token_ids == full.token_ids[:n]
        streamed = list(engine.stream(prompt, params))
        assert "".join(d.text for d in streamed) == result.text
        assert all(stop not in d.text for d in streamed)
        inside_block += any(b < n < e for b, e in spans)  # the completing token was not a round's last
    assert inside_block >= 1


def test_stop_strings_without_a_tokenizer_are_refused():
    target = tiny_target()
    engine = Engine(target, tiny_drafter(target))
    with pytest.raises(DDTreeError, match="stop strings need a tokenizer"):
        engine.generate([1, 2, 3], SamplingParams(stop=("x",)))
