"""Incremental text: what streams, what a request ends with and the tokenizer's own decode agree, cut at the
first stop string, for random outputs of byte-level tokens that split multi-byte characters across rounds.

The oracle is the whole-output decode the engine used before (decode every prefix, find the earliest stop
string, keep the token that completed it): exact, and O(length^2)."""

from __future__ import annotations

import random

import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

from ddtree.engine import Engine
from ddtree.model.loader import DEFAULT_TARGET, load_target
from ddtree.request.detokenize import IncrementalDetokenizer
from ddtree.request.output import OutputState
from ddtree.request.params import SamplingParams

EOS = 0  # the built-in tokenizer's <|endoftext|>; <|mask|> (1) is special too
BYTE_TOKENS = bytes_to_unicode()
TEXTS = [
    "def f(x):\n    return x",
    "naïve café",
    "日本語のテキスト",
    "emoji 😀🎉 ok",
    "a\u0301 Ω ≤ ∑",
    "x = 1  # ß",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_target(DEFAULT_TARGET)[1]


class WithoutRustCore:
    """The tokenizer's ``decode`` only: drives the detokenizer's path for tokenizers without a Rust core."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


def oracle(tokenizer, ids: list[int], params: SamplingParams, stop_ids: set[int]) -> tuple[list[int], str]:
    """The emitted ids and the final text, decoding from scratch (the engine's rule before incremental
    text)."""
    kept: list[int] = []
    for token in ids:
        kept.append(token)
        if token in stop_ids or len(kept) >= params.max_new_tokens:
            break

    def text(count: int) -> str:
        part = kept[:count]
        if part and part[-1] in stop_ids:
            part = part[:-1]
        return tokenizer.decode(part, skip_special_tokens=True)

    def find(t: str) -> int | None:
        hits = [i for i in (t.find(s) for s in params.stop) if i >= 0]
        return min(hits) if hits else None

    for count in range(1, len(kept) + 1):
        at = find(text(count))
        if at is not None:
            return kept[:count], text(count)[:at]
    return kept, text(len(kept))


def random_ids(rng: random.Random, tokenizer) -> list[int]:
    """Tokens of mixed scripts, some single bytes of multi-byte characters, some special, some random."""
    ids: list[int] = []
    while len(ids) < rng.randint(5, 60):
        kind = rng.random()
        if kind < 0.5:
            ids += tokenizer.encode(rng.choice(TEXTS), add_special_tokens=False)
        elif kind < 0.8:  # single-byte tokens: a character's bytes, one token each
            raw = rng.choice(TEXTS).encode()
            start = rng.randrange(len(raw))
            ids += [tokenizer.convert_tokens_to_ids(bytes_to_token(b)) for b in raw[start : start + 5]]
        elif kind < 0.9:
            ids.append(rng.choice([EOS, 1]))
        else:
            ids.append(rng.randrange(2, len(tokenizer)))
    return ids


def bytes_to_token(b: int) -> str:
    """The byte-level (GPT-2) token string of the single byte ``b``."""
    return BYTE_TOKENS[b]


@pytest.mark.parametrize("rust_core", [True, False])
def test_streamed_text_equals_the_final_text_and_the_tokenizers_decode_cut_at_the_stop(tokenizer, rust_core):
    rng = random.Random(20261201 + rust_core)
    tok = tokenizer if rust_core else WithoutRustCore(tokenizer)
    cases = 0
    for _ in range(250):
        ids = random_ids(rng, tokenizer)
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        stops: list[str] = []
        for _ in range(rng.randint(0, 3)):  # substrings of the text (they hit, often across rounds) or not
            if whole and rng.random() < 0.8:
                i = rng.randrange(len(whole))
                stops.append(whole[i : i + rng.randint(1, 6)])
            else:
                stops.append(rng.choice(["zzz", "\n\n", "é€", "😀x", "\ufffd"]))
        # U+FFFD included: the oracle's prefix decodes show an unfinished character as one, and stop there
        stops = [s for s in stops if s]
        params = SamplingParams(
            max_new_tokens=rng.randint(1, 80), stop=tuple(stops), ignore_eos=rng.random() < 0.3
        )
        stop_ids = set() if params.ignore_eos else {EOS}
        out = OutputState(params, frozenset({EOS}), tok)
        streamed, i = "", 0
        while out.finish_reason is None and i < len(ids):
            size = rng.randint(1, 16)  # one round's accepted tokens
            out.write(ids[i : i + size])
            i += size
            streamed += out.new_text()
        if out.finish_reason is None:  # the ids ran out first: the engine would go on; end it here
            continue
        cases += 1
        expected_ids, expected_text = oracle(tokenizer, ids, params, stop_ids)
        assert out.token_ids == expected_ids, (ids, params)
        assert out.text == expected_text == streamed, (ids, params)
    assert cases >= 200


def test_the_detokenizer_holds_a_split_character_until_it_is_whole(tokenizer):
    ids = [tokenizer.convert_tokens_to_ids(bytes_to_token(b)) for b in "é😀".encode()]  # 2 + 4 bytes
    detok = IncrementalDetokenizer(tokenizer)
    chunks = [detok.push(t) for t in ids]
    assert chunks == ["", "é", "", "", "", "😀"]
    assert "".join(chunks) == "é😀"
    assert detok.push(ids[2]) == ""  # the first byte of another emoji, never finished
    assert detok.flush() == tokenizer.decode(ids[2:3]) == "\ufffd"


@pytest.mark.parametrize("rust_core", [True, False])
def test_special_tokens_stay_in_the_text_when_asked(tokenizer, rust_core):
    """A tool parser reads markers that may be special tokens (kimi_k2's): ``skip_special_tokens=False``
    keeps them, as the tokenizer's decode does; EOS still ends the request outside the text."""
    ids = (
        tokenizer.encode("x = <", add_special_tokens=False)
        + [1]
        + tokenizer.encode(" y", add_special_tokens=False)
    )
    source = tokenizer if rust_core else WithoutRustCore(tokenizer)
    for skip in (True, False):
        out = OutputState(
            SamplingParams(max_new_tokens=50), frozenset({EOS}), source, skip_special_tokens=skip
        )
        out.write([*ids, EOS, 5])
        assert (
            out.text
            == tokenizer.decode(ids, skip_special_tokens=skip)
            == ("x = < y" if skip else "x = <<|mask|> y")
        )


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_engine_streams_equal_results_equal_decode_for_every_method(method):
    engine = Engine.from_pretrained(method=method, budget=16)
    rng = random.Random(method)
    full = engine.generate("def fibonacci(n):", SamplingParams(max_new_tokens=60, ignore_eos=True))
    for _ in range(8):
        i = rng.randrange(len(full.text) - 4)
        stop = full.text[i : i + rng.randint(2, 5)]
        params = SamplingParams(max_new_tokens=60, ignore_eos=True, stop=(stop,))
        deltas = list(engine.stream("def fibonacci(n):", params))
        result = engine.generate("def fibonacci(n):", params)
        streamed = "".join(d.text for d in deltas)
        ids = [t for d in deltas for t in d.token_ids]
        decoded = engine.tokenizer.decode(ids, skip_special_tokens=True)
        assert streamed == result.text == decoded[: decoded.find(stop)] == full.text[: full.text.find(stop)]
        assert result.finish_reason == "stop" and ids == result.token_ids
