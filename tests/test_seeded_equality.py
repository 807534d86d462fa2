"""A seed is an answer: seeded sampling emits plain decoding's tokens at every method, budget and batch.

The coin of output position t is a function of (the request's key, t) alone (``ddtree.speculative.coins``)
and every method emits the target's inverse-CDF sample at it, so seeded ``ddtree`` (budgets 1, 16, auto)
and ``dflash`` must equal seeded ``ar`` token for token: alone, in mixed batches with greedy and other
sampled rows, across preemption, prefix-cache hits and compilation, and through the server under its
default flags. The verify forward and the plain forward may differ in the last bits; a position where
the two disagree is accepted only if plain decoding's coin lies within ``TIE`` of a CDF boundary of the
target's distribution there (computed with HF's own forward), and is reported.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import pytest
import torch

from ddtree.engine import Engine
from ddtree.request.params import SamplingParams, StructuredOutputs
from ddtree.server import ServerConfig, create_app
from ddtree.speculative import coins
from ddtree.speculative.sampling import SamplingTensors
from tests.oracles import filtered_probs_reference
from tests.server_helpers import ThreadServer

NEW = 40
TIE = 1e-5  # a coin this close to a CDF boundary may fall either side under last-bit differences
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):", "x = ["]
SETTINGS = {
    "T=0.6": SamplingParams(temperature=0.6),
    "T=1 top-p": SamplingParams(temperature=1.0, top_p=0.9),
    "T=0.8 top-k": SamplingParams(temperature=0.8, top_k=20),
    "T=1 min-p penalty": SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2),
    "T=0.7 json": SamplingParams(
        temperature=0.7, structured_outputs=StructuredOutputs.of_schema({"type": "object"})
    ),
}
RUNS = [("dflash", None), ("ddtree", 1), ("ddtree", 16), ("ddtree", "auto")]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def engine(request) -> Engine:
    """Both precisions: bfloat16 (the built-in pair's own, ``--dtype auto``) holds seeded rows to plain
    decoding's bits through the batch-invariant path (``ddtree.model.invariance``)."""
    return Engine.from_pretrained(dtype=request.param, max_num_seqs=8)


def params(setting: str, seed: int) -> SamplingParams:
    sp = SETTINGS[setting]  # a grammar ends its text with EOS; the others run to NEW tokens
    return replace(sp, seed=seed, max_new_tokens=NEW, ignore_eos=sp.structured_outputs is None)


def assert_same_or_ties(
    engine: Engine, prompt: str, sp: SamplingParams, ar: list[int], got: list[int]
) -> None:
    """``got`` equals ``ar``, or first differs where plain decoding's coin sits on a CDF boundary."""
    if got == ar:
        return
    t = next(i for i, (a, b) in enumerate(zip(ar, got, strict=False)) if a != b)
    ids = torch.tensor([engine.encode(prompt) + ar[:t]])
    with torch.no_grad():
        logits = engine.target(input_ids=ids).logits[0, -1].float()
    # the request's temperature, top-k, top-p and min-p by the sort-based reference (penalties and
    # grammar masks are not applied: a tie under those settings would be reported against the raw law)
    probs = filtered_probs_reference(logits[None, None], SamplingTensors.from_params([sp]))[0, 0].double()
    cdf = probs.cumsum(0)
    coin = float(coins.coins_at(torch.tensor(coins.key_of(sp.seed)), torch.tensor(t)))
    gap = float((cdf - coin).abs().min())
    print(f"position {t}: tokens {ar[t]} vs {got[t]}, coin {coin:.8f} {gap:.2e} from a CDF boundary")
    assert gap < TIE, f"position {t} differs with the coin {gap:.2e} from any CDF boundary"


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_seeded_speculation_emits_seeded_plain_decodings_tokens(engine, setting):
    for seed, prompt in enumerate(PROMPTS):
        sp = params(setting, seed)
        ar = engine.generate(prompt, sp, method="ar").token_ids
        assert len(ar) == NEW or sp.structured_outputs is not None
        for method, budget in RUNS:
            got = engine.generate(prompt, sp, method=method, budget=budget).token_ids
            assert_same_or_ties(engine, prompt, sp, ar, got)


def test_seeded_rows_in_a_mixed_batch_emit_their_solo_plain_tokens(engine):
    """Every (setting, method) seeded row shares its rounds with greedy rows and other sampled rows of
    every method; each emits what it emits alone with ``ar``."""
    requests, expected = [], []
    for i, setting in enumerate(SETTINGS):
        for method, budget in RUNS:
            sp = params(setting, 100 + i)
            prompt = PROMPTS[i % len(PROMPTS)]
            requests.append((prompt, sp, method, budget))
            expected.append(engine.generate(prompt, sp, method="ar").token_ids)
        requests.append((PROMPTS[i % len(PROMPTS)], SamplingParams(max_new_tokens=NEW), "ddtree", 16))
        expected.append(None)
    ids = [engine.add_request(p, sp, method=m, budget=b) for p, sp, m, b in requests]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out[delta.request_id] += delta.token_ids
    for (prompt, sp, _, _), request_id, ar in zip(requests, ids, expected, strict=True):
        if ar is not None:
            assert_same_or_ties(engine, prompt, sp, ar, out[request_id])


def test_preemption_and_a_prefix_cache_hit_change_no_seeded_token(engine):
    """A pool too small for every row preempts and resumes rows mid-output; a repeated prompt hits the
    prefix cache: each seeded row still emits its plain tokens."""
    small = Engine(
        engine.target, engine.runner.drafter, engine.tokenizer, max_num_seqs=6, max_model_len=160,
        kv_cache_memory=14 * 16 * engine.runner.kv_cache_bytes_per_token * 2,
    )  # fmt: skip
    prompts = [PROMPTS[i % len(PROMPTS)] * 3 for i in range(6)]
    sps = [params("T=1 top-p", 200 + i) for i in range(6)]
    expected = [engine.generate(p, sp, method="ar").token_ids for p, sp in zip(prompts, sps, strict=True)]
    results = small.generate(prompts, sps, method="ddtree", budget=16)
    assert small.num_preemptions > 0
    for p, sp, ar, r in zip(prompts, sps, expected, results, strict=True):
        assert_same_or_ties(engine, p, sp, ar, r.token_ids)
    again = small.generate(prompts[0], sps[0], method="dflash")  # its prompt's blocks are cached
    assert again.stats.cached_tokens > 0
    assert_same_or_ties(engine, prompts[0], sps[0], expected[0], again.token_ids)


def test_a_chunked_prefill_changes_no_seeded_token(engine):
    """Prompts longer than a step's token budget are prefilled in several chunks, beside other rows'
    rounds: each seeded row, of every method, still emits its plain tokens of an unchunked prefill."""
    chunked = Engine(
        engine.target, engine.runner.drafter, engine.tokenizer, max_num_seqs=4, max_num_batched_tokens=24,
        enable_prefix_caching=False,
    )  # fmt: skip
    prompts = [p * 12 for p in PROMPTS]  # 36 to 132 tokens
    assert all(len(engine.encode(p)) > 24 for p in prompts)
    sps = [params("T=0.8 top-k", 300 + i) for i in range(len(prompts))]
    expected = [engine.generate(p, sp, method="ar").token_ids for p, sp in zip(prompts, sps, strict=True)]
    prefill, chunks = chunked.runner.prefill, []

    def spy(batch, tables, **options):
        chunks.extend(len(ids) for ids, _ in batch)
        return prefill(batch, tables, **options)

    chunked.runner.prefill = spy
    for method, budget in [("ar", None), *RUNS]:
        results = chunked.generate(prompts, sps, method=method, budget=budget)
        for p, sp, ar, r in zip(prompts, sps, expected, results, strict=True):
            assert_same_or_ties(engine, p, sp, ar, r.token_ids)
    assert max(chunks) <= 24 and len(chunks) >= 2 * len(prompts) * (1 + len(RUNS))  # every prompt chunked


def test_a_position_reused_coin_is_a_different_sampler(engine, monkeypatch):
    """The equality above is no accident of the models: with every position given position 0's coin the
    seeded outputs change (the statistical check of that mutation: test_sampling_lossless.py)."""
    sp = params("T=1 top-p", 7)
    honest = engine.generate(PROMPTS[0], sp, method="ddtree", budget=16).token_ids
    real = coins.coins_at
    monkeypatch.setattr("ddtree.engine.verifier.coins_at", lambda keys, positions: real(keys, positions * 0))
    assert engine.generate(PROMPTS[0], sp, method="ddtree", budget=16).token_ids != honest


def test_the_server_repeats_a_seeded_answer_alone_and_among_other_requests():
    """Default engine and server settings (budget auto, the built-in pair in bfloat16): the same seeded
    request 5 times alone and 5 times among 8 other requests returns the same text every time."""
    body = {"model": "ddtree-default", "prompt": "def parse(line):", "max_tokens": 32, "temperature": 0.9,
            "top_p": 0.95, "seed": 1234}  # fmt: skip
    others = [
        {
            "model": "ddtree-default",
            "prompt": f"class C{i}:",
            "max_tokens": 24 + i,
            "temperature": 0.7 + i / 20,
        }
        for i in range(8)
    ]
    with ThreadServer(create_app(Engine.from_pretrained, ServerConfig())) as server:

        async def run() -> list[str]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:

                async def text(payload: dict) -> str:
                    answer = await client.post("/v1/completions", json=payload)
                    assert answer.status_code == 200, answer.text
                    return answer.json()["choices"][0]["text"]

                alone = [await text(body) for _ in range(5)]
                crowded = []
                for _ in range(5):
                    *_, mine = await asyncio.gather(*(text(o) for o in others), text(body))
                    crowded.append(mine)
                return alone + crowded

        texts = asyncio.run(run())
    assert len(set(texts)) == 1, texts


def test_coins_are_uniform_independent_across_positions_and_the_same_compiled():
    """2,000 keys x 2,000 positions: a chi-square over 64 bins passes, neighbouring positions and keys are
    uncorrelated, every coin lies in [0, 1), and torch.compile computes the same bits."""
    from scipy.stats import chisquare

    keys = torch.tensor([coins.key_of(seed) for seed in range(-1000, 1000)])[:, None]  # negative seeds too
    positions = torch.arange(2000)[None]
    u = coins.coins_at(keys, positions)  # [2000, 2000]
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u, bins=64, min=0.0, max=1.0).numpy()
    assert chisquare(counts).pvalue > 1e-3
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):
        assert abs(float(torch.corrcoef(torch.stack((a.flatten(), b.flatten())))[0, 1])) < 0.01
    assert torch.equal(torch.compile(coins.coins_at)(keys, positions), u)
