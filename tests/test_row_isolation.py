"""A step that fails because of one request fails that request alone: the others keep their outputs.

Every input the engine accepts is meant to be safe, so the faults here are injected: a round or a prefill
whose computation raises when a poisoned request is among its rows (after the sampled rows have drawn
their coins, so a companion's seeded output is only right if its generator is rewound), and a request
whose output raises while it is written. Companions (greedy and seeded sampling, every method) must emit
exactly what they emit alone; the poisoned request ends with finish_reason "error" and the reason.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from ddtree.engine import Engine
from ddtree.request.params import SamplingParams
from ddtree.server import ServerConfig, create_app
from tests.server_helpers import ThreadServer, metric, scrape, sse_events

NEW = 24
COMPANIONS = [
    ("def fibonacci(n):", SamplingParams(max_new_tokens=NEW), "ddtree"),
    ("import os\nimport sys\n", SamplingParams(max_new_tokens=NEW), "dflash"),
    ("class Stack:", SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_new_tokens=NEW), "ddtree"),
    ("for i in range(10):", SamplingParams(temperature=1.0, top_k=20, seed=2, max_new_tokens=NEW), "dflash"),
    ("x = [1, 2, 3]\n", SamplingParams(temperature=0.6, seed=3, max_new_tokens=NEW), "ar"),
]
POISON = "def poison():"


@pytest.fixture(scope="module")
def engine() -> Engine:
    # float32: seeded companions equal their solo runs where the forwards agree to the bit (not bfloat16's)
    return Engine.from_pretrained(max_batch_size=8, budget=16, dtype=torch.float32)


@pytest.fixture(scope="module")
def solo(engine: Engine) -> list[list[int]]:
    return [engine.generate(p, params, method=m).token_ids for p, params, m in COMPANIONS]


def poisoned(rows) -> bool:
    return any(r.prompt_ids == POISON_IDS for r in rows)


POISON_IDS: list[int] = []


def inject(engine: Engine, monkeypatch, where: str) -> None:
    """Make ``where`` (the round's acceptance, or the prefill's first tokens) raise whenever the poisoned
    request is among its rows; the real work runs first, so sampled rows have drawn their coins."""
    POISON_IDS[:] = engine.encode(POISON)
    if where == "round":
        real = engine.verifier.accept

        def accept(rows, *args):
            out = real(rows, *args)
            if poisoned(rows):
                raise RuntimeError("injected fault in a round")
            return out

        monkeypatch.setattr(engine.verifier, "accept", accept)
    else:
        real_first = engine.verifier.first_tokens

        def first_tokens(logits, rows):
            out = real_first(logits, rows)
            if poisoned(rows):
                raise RuntimeError("injected fault in a prefill")
            return out

        monkeypatch.setattr(engine.verifier, "first_tokens", first_tokens)


@pytest.mark.parametrize("where", ["round", "prefill"])
def test_a_request_whose_step_raises_fails_alone_and_its_companions_emit_their_solo_tokens(
    engine, solo, monkeypatch, where
):
    inject(engine, monkeypatch, where)
    ids = [engine.add_request(p, params, method=m) for p, params, m in COMPANIONS]
    bad = engine.add_request(POISON, SamplingParams(temperature=1.0, seed=9, max_new_tokens=NEW))
    ids.insert(2, engine.add_request("while True:", SamplingParams(max_new_tokens=NEW)))  # after the poison
    results: dict[str, list] = {i: [] for i in [*ids, bad]}
    ends: dict[str, tuple] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            results[delta.request_id] += delta.token_ids
            if delta.finish_reason is not None:
                ends[delta.request_id] = (delta.finish_reason, delta.error)
    assert ends[bad][0] == "error" and f"injected fault in a {where}" in ends[bad][1]
    companions = [results[i] for i in ids[:2] + ids[3:]]
    assert companions == solo
    assert all(ends[i] == ("length", None) for i in ids)
    assert engine.blocks.num_used == 0


def test_a_request_whose_output_raises_while_written_fails_alone(engine, solo):
    ids = [engine.add_request(p, params, method=m) for p, params, m in COMPANIONS]
    bad = engine.add_request(POISON, SamplingParams(max_new_tokens=NEW))
    request = next(r for r in engine.scheduler.waiting if r.request_id == bad)
    real_write = request.output.write

    def write(tokens, logprobs):
        if len(request.output.token_ids) >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_write(tokens, logprobs)

    request.output.write = write
    outputs: dict[str, list] = {i: [] for i in [*ids, bad]}
    ends: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs[delta.request_id] += delta.token_ids
            if delta.finish_reason is not None:
                ends[delta.request_id] = delta.finish_reason
    assert ends[bad] == "error" and len(outputs[bad]) >= 3
    assert [outputs[i] for i in ids] == solo


def test_a_step_that_fails_for_every_request_alone_is_the_engines_fault_and_raises(engine, monkeypatch):
    def accept(*args):
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(engine.verifier, "accept", accept)
    ids = [engine.add_request(p, params, method=m) for p, params, m in COMPANIONS[:3]]
    with pytest.raises(RuntimeError, match="injected device fault"):
        while engine.has_unfinished_requests():
            engine.step()
    for request_id in ids:
        engine.abort(request_id)
    engine.step()


def test_the_server_answers_the_failed_request_alone_and_every_stream_completes(engine, solo, monkeypatch):
    inject(engine, monkeypatch, "round")
    body = {"model": "tiny", "max_tokens": NEW, "stream": True}

    def request(prompt: str, params: SamplingParams, method: str) -> dict:
        fields = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
        if params.seed is not None:
            fields["seed"] = params.seed
        return body | fields | {"prompt": prompt, "speculative": {"method": method, "budget": 16}}

    expected = [engine.tokenizer.decode(t) for t in solo]
    with ThreadServer(create_app(lambda: engine, ServerConfig(model_name="tiny"))) as server:

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                streams = [http.post("/v1/completions", json=request(*c)) for c in COMPANIONS]
                hostile = http.post(
                    "/v1/completions", json={"model": "tiny", "prompt": POISON, "max_tokens": NEW}
                )
                return await asyncio.gather(*streams, hostile)

        *answers, failed = asyncio.run(main())
        assert failed.status_code == 500, failed.text
        assert failed.json()["error"]["code"] == "request_failed"
        assert "injected fault in a round" in failed.json()["error"]["message"]
        for answer, text in zip(answers, expected, strict=True):
            events = sse_events(answer.text.splitlines())
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text
        samples = scrape(server.url)
        assert metric(samples, "ddtree_kv_cache_blocks", state="used") == 0
        assert httpx.get(f"{server.url}/ready").status_code == 200
