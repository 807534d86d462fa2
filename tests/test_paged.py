"""The paged KV cache: a pool sized by the memory budget, blocks taken as requests grow and returned when
they end, preemption that changes no output, and chunked prefill that keeps running streams going."""

from __future__ import annotations

import logging
import random
import subprocess
import sys

import pytest
import torch

from ddtree import Engine, SamplingParams
from ddtree.engine import memory
from ddtree.errors import DDTreeError
from ddtree.model.kv_cache import KVLayout, PagedKVCache
from ddtree.request.params import parse_size
from tests.conftest import VOCAB, tiny_drafter, tiny_target

PROMPTS = [[1, 5, 9, 22, 3], [7], [30, 2, 2, 14, 8, 19, 25, 11, 4, 0, 6, 13]]


def tokens(n: int, salt: int = 0) -> list[int]:
    return [2 + (salt + 5 * j) % (VOCAB - 3) for j in range(n)]


@pytest.fixture(scope="module")
def models():
    target = tiny_target()
    target.config.max_position_embeddings = 4096  # room for a 3,000-token prompt
    return target, tiny_drafter(target)


def engine(models, **options) -> Engine:
    # A fixed tree (seeded samples repeat only with one) and scheduling that does not depend on timing.
    return Engine(*models, **({"max_model_len": 256, "budget": 16, "prefill_gap_rounds": None} | options))


def run(engine: Engine, specs: list[tuple[list[int], SamplingParams, str]]) -> list[list[int]]:
    """Every spec as one request, all in flight together; their token ids in order."""
    ids = [engine.add_request(p, params, method=m) for p, params, m in specs]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for d in engine.step():
            out[d.request_id] += d.token_ids
    return [out[i] for i in ids]


def assert_pool_whole(e: Engine) -> None:
    assert e.blocks.num_free == e.blocks.num_blocks - 1 and e.blocks.num_used == 0
    assert not e.scheduler.running and not e.scheduler.waiting


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("8G", 8 * 10**9), ("1e9", 10**9), ("123", 123)],
)
def test_memory_sizes_read_like_vllm(text, expected):
    assert parse_size(text) == expected


def test_a_kv_cache_memory_over_what_the_device_has_is_one_line(models):
    """Tried: 100 GiB on a 24 GB machine built a lazily allocated 72.5 GiB pool and said nothing."""
    free, _, _ = memory.available_memory(torch.device("cpu"))
    with pytest.raises(DDTreeError, match="more than this device has"):
        engine(models, kv_cache_memory=2 * free)


@pytest.mark.parametrize("text", ["lots", "-1GiB", "0", "4 XB"])
def test_a_memory_size_that_is_not_one_is_refused_in_one_line(text):
    with pytest.raises(DDTreeError, match="memory size") as info:
        parse_size(text)
    assert "\n" not in str(info.value)


def test_the_pool_holds_what_kv_cache_memory_buys(models):
    e = engine(models, kv_cache_memory="2MiB")
    runner = e.runner
    assert runner.num_blocks - 1 == (2 << 20) // runner.block_bytes  # plus the scratch block
    assert runner.kv_cache_bytes == runner.num_blocks * runner.block_bytes
    keys = runner.cache.keys[0]
    assert keys.shape[:2] == (runner.num_blocks, 16)  # [num_blocks, block_size, kv_heads, D]


def test_the_pool_is_capped_at_every_row_at_full_length(models):
    e = engine(models, kv_cache_memory="1GiB", max_num_seqs=3)
    assert e.runner.num_blocks - 1 == 3 * e.runner.width


def test_the_pool_grows_with_the_memory_share(models, monkeypatch):
    """Without --kv-cache-memory the pool is the share of the available memory less the activations: each
    extra tenth of it buys a tenth of the memory in blocks."""
    monkeypatch.setattr(memory, "available_memory", lambda device: (200 << 20, 200 << 20, "200 MiB"))
    monkeypatch.setattr(memory, "extrapolated_peak", lambda *a: lambda blocks: 30 << 20)
    sizes = {u: engine(models, gpu_memory_utilization=u, max_model_len=4096).runner for u in (0.5, 0.6)}
    assert sizes[0.6].num_blocks - 1 < 16 * sizes[0.6].width  # below the cap: the share decides
    extra = (sizes[0.6].num_blocks - sizes[0.5].num_blocks) * sizes[0.5].block_bytes
    assert abs(extra - 0.1 * (200 << 20)) <= sizes[0.5].block_bytes


def test_where_activations_could_decide_the_pool_it_gets_what_the_profiled_step_leaves(models, monkeypatch):
    """vLLM's profiling run: the largest step (prefill chunk, widest round) runs once and the pool gets the
    share less its measured peak; with memory to spare nothing runs and nothing is reserved twice."""
    runner = engine(models, max_model_len=4096).runner  # 24 GB here: the pool is capped long before
    assert runner.profiled_activation_bytes is None
    monkeypatch.setattr(memory, "available_memory", lambda device: (1 << 30, 1 << 30, "1 GiB"))
    # A share of 410 MiB less the peak (on a CPU the reduced profile's, with its margin and slack: at
    # least 64 MiB, at most a few hundred here) buys fewer blocks than the cap (every row at full length,
    # 64 x 257 x 24 KiB = 385 MiB), so the share decides the pool whatever the peak.
    runner = engine(
        models, max_model_len=4096, max_num_batched_tokens=1024, gpu_memory_utilization=0.4, max_num_seqs=64
    ).runner
    peak = runner.profiled_activation_bytes
    assert peak is not None and peak >= memory.PROFILE_SLACK
    assert runner.num_blocks - 1 == (int(0.4 * (1 << 30)) - peak) // runner.block_bytes


PEAK_STEPS = """
import torch
from ddtree.engine import memory

mib = 1 << 20


def at_once() -> None:
    parts = [torch.ones(64 * mib // 4) for _ in range(4)]  # touched: resident
    del parts


def one_at_a_time() -> None:
    for _ in range(4):
        torch.ones(64 * mib // 4).sum()


print(memory.peak_bytes(torch.device("cpu"), at_once), memory.peak_bytes(torch.device("cpu"), one_at_a_time))
"""


def test_the_profiled_peak_sees_what_a_step_holds_at_once():
    """``peak_bytes`` on this CPU (the peak resident set): a step that holds 256 MiB at once, then frees
    it, peaks at about 256 MiB; one that holds 64 MiB four times over, one at a time, at about 64. In a
    process of its own: the resident set is the whole process's, and in a test worker another test's
    leftover threads (a server's, a tokenizer's) allocating meanwhile read as the step's (129 MiB once)."""
    mib = 1 << 20
    out = subprocess.run([sys.executable, "-c", PEAK_STEPS], capture_output=True, text=True, check=True)
    big, small = map(int, out.stdout.split())
    assert 240 * mib <= big <= 300 * mib, big / mib
    assert small <= 100 * mib, small / mib


def test_a_budget_short_of_one_request_names_the_flags(models):
    with pytest.raises(DDTreeError, match="--kv-cache-memory or --gpu-memory-utilization") as info:
        engine(models, kv_cache_memory="64KiB", max_model_len=256)
    assert "max_model_len 256" in str(info.value) and "--max-model-len" in str(info.value)
    assert "\n" not in str(info.value)


def test_the_models_context_is_lowered_to_what_the_budget_holds(models, caplog):
    """No --max-model-len: the model's context (4,096 here) shrinks to fit, with a warning, as vLLM's
    --max-model-len auto does."""
    with caplog.at_level(logging.WARNING, logger="ddtree.engine.memory"):
        e = Engine(*models, kv_cache_memory="256KiB")
    assert 0 < e.max_model_len < 4096
    assert e.runner.width * e.blocks.block_size <= 256 * 1024 // e.runner.block_bytes * 16
    assert "max_model_len is" in caplog.text
    with pytest.raises(DDTreeError, match="exceeds the context"):
        e.add_request(tokens(8), SamplingParams(max_new_tokens=e.max_model_len))


@pytest.fixture(scope="module")
def half_models():
    """The tiny pair in bf16: on a CPU its pools may hold float32 keys and values (``memory.plan_pool``)."""
    target = tiny_target().to(torch.bfloat16)
    return target, tiny_drafter(target).to(torch.bfloat16)


@pytest.mark.parametrize("explicit", [True, False])
def test_a_float32_pool_never_costs_a_half_precision_model_context(half_models, explicit):
    """On a CPU a bf16 model's pool holds float32 keys and values (faster attention there) where that
    fits as long a context as bf16 does; a budget that holds one whole request in bf16 but not in float32
    gets a bf16 pool and the whole context, not a lowered one or an error."""
    length = 256 if explicit else half_models[0].config.max_position_embeddings
    options = {"max_model_len": length} if explicit else {"max_model_len": None}
    ample = engine(half_models, kv_cache_memory="64MiB", **options)
    assert ample.runner.cache.dtype == torch.float32 and ample.max_model_len == length
    wide_request = ample.runner.width * ample.runner.block_bytes  # one request's blocks, in float32
    tight = engine(half_models, kv_cache_memory=int(0.75 * wide_request), **options)
    assert tight.runner.cache.dtype == tight.runner.draft_cache.dtype == torch.bfloat16
    assert tight.max_model_len == length
    assert tight.runner.block_bytes * 2 == ample.runner.block_bytes
    assert [e.kv_cache_summary()["kv_cache_dtype"] for e in (ample, tight)] == ["float32", "bfloat16"]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    assert run(tight, [(PROMPTS[0], params, "ddtree")]) == run(tight, [(PROMPTS[0], params, "ar")])


def test_the_kv_cache_dtype_the_user_names_is_the_pools(half_models):
    """``kv_cache_dtype`` overrides auto's choice: the model's dtype where float32 would fit (more
    requests at once), float32 where it costs context (the user's trade), and a dtype narrower than or
    unlike the model's is a one-line error naming the choices."""
    ample = engine(half_models, kv_cache_memory="64MiB", kv_cache_dtype="bfloat16")
    assert ample.runner.cache.dtype == torch.bfloat16
    tight = int(0.75 * ample.runner.width * 2 * ample.runner.block_bytes)  # one request: bf16 yes, float32 no
    assert engine(half_models, kv_cache_memory=tight).runner.cache.dtype == torch.bfloat16  # auto
    with pytest.raises(DDTreeError, match="max_model_len 256"):
        engine(half_models, kv_cache_memory=tight, kv_cache_dtype="float32")
    lowered = engine(half_models, kv_cache_memory=tight, kv_cache_dtype="float32", max_model_len=None)
    context = half_models[0].config.max_position_embeddings
    assert lowered.runner.cache.dtype == torch.float32 and lowered.max_model_len < context
    with pytest.raises(DDTreeError, match=r"not this model's dtype \(bfloat16\) or float32") as info:
        engine(half_models, kv_cache_dtype="float16")
    assert "\n" not in str(info.value)
    with pytest.raises(DDTreeError, match="kv_cache_dtype must be one of auto, bfloat16, float16, float32"):
        engine(half_models, kv_cache_dtype="fp8")


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_outputs_do_not_depend_on_the_block_size(models, block_size):
    specs = [
        (PROMPTS[i % len(PROMPTS)], SamplingParams(max_new_tokens=30, ignore_eos=True), m)
        for i, m in enumerate(["ddtree", "dflash", "ar", "ddtree"])
    ]
    specs.append((PROMPTS[1], SamplingParams(temperature=1.0, seed=3, max_new_tokens=30), "ddtree"))
    reference = run(engine(models, block_size=64), specs)
    e = engine(models, block_size=block_size)
    assert run(e, specs) == reference
    assert_pool_whole(e)


def test_eager_reads_gather_each_rows_blocks_into_the_pools_kept_buffers():
    """A forward's reads are each row's own blocks in table order, the new tokens included, gathered into
    the pool's two read buffers: every layer and every forward up to the largest read so far reuses them
    (a fresh multi-megabyte tensor per layer cost the CPU a page fault per 4 KiB), keys apart from
    values; a larger read grows them."""
    bs, width, kvh, d = 4, 6, 2, 8
    cache = PagedKVCache(2, 40, bs, width, KVLayout.gqa(kvh, d), torch.float32, "cpu")
    for buf in (*cache.keys, *cache.values):
        buf.normal_()
    gen = torch.Generator().manual_seed(0)
    owned = (torch.randperm(39, generator=gen)[: 3 * width] + 1).view(3, width)  # never the scratch block
    tables = torch.cat([owned, torch.zeros(3, 1, dtype=torch.int64)], dim=1)  # [3, width + 1]
    pointers = set()
    for span, cols in ((16, [[3], [9], [15]]), (8, [[0], [5], [7]]), (24, [[20], [2], [23]])):
        write = cache.at(tables, torch.tensor(cols), span)
        for layer in range(2):
            k, v = torch.randn(3, kvh, 1, d), torch.randn(3, kvh, 1, d)
            keys, values = write.write(layer, k, v)  # [3, kvh, span, D] each
            for row, (col,) in enumerate(cols):
                want = cache.keys[layer][owned[row, : span // bs]].flatten(0, 1)  # [span, kvh, D]
                assert torch.equal(keys[row].transpose(0, 1), want)
                assert torch.equal(keys[row, :, col], k[row, :, 0])
                assert torch.equal(values[row, :, col], v[row, :, 0])
            pointers.add((span, keys.data_ptr(), values.data_ptr()))
    (_, k16, v16), (_, k8, v8), (_, k24, v24) = sorted(pointers, key=lambda p: [16, 8, 24].index(p[0]))
    assert len(pointers) == 3  # one pair of buffers per forward, shared by both layers
    assert (k8, v8) == (k16, v16) and k16 != v16  # a smaller read reuses them; keys apart from values
    assert cache.read_buffers[0].shape[0] == 3 * 24 // bs  # grown to the largest read


def test_a_finished_request_frees_its_blocks_and_moves_nobody_elses(models):
    e = engine(models)
    short = e.add_request(PROMPTS[0], SamplingParams(max_new_tokens=3, ignore_eos=True))
    e.add_request(PROMPTS[1], SamplingParams(max_new_tokens=60, ignore_eos=True))
    e.step()  # both prefilled
    long_ = next(r for r in e.running if r.request_id != short)
    used = e.blocks.num_used
    while any(r.request_id == short for r in e.running):
        blocks_before, committed = list(long_.blocks), long_.start
        keys_before = e.runner.cache.keys[0][blocks_before].clone()
        e.step()
    assert long_.blocks[: len(blocks_before)] == blocks_before
    # Its committed keys stayed where they were through the round that released the short request.
    after = e.runner.cache.keys[0][blocks_before].flatten(0, 1)[:committed]
    assert torch.equal(after, keys_before.flatten(0, 1)[:committed])
    assert e.blocks.num_used < used + 2  # the short one's blocks came back


def test_preempted_requests_resume_with_the_tokens_of_their_solo_run(models):
    """A pool of about three long requests' worth and 12 long requests at once: rows are preempted when
    the pool runs out and recomputed later; every request completes with its solo run's tokens."""
    probe = engine(models)
    per_request = -(-(20 + 150 + probe.runner.drafter.block_size) // 16)  # blocks of one whole request
    e = engine(models, kv_cache_memory=3 * per_request * probe.runner.block_bytes, max_num_seqs=12)
    specs = []
    for i in range(12):
        prompt = tokens(20, salt=7 * i)
        params = SamplingParams(max_new_tokens=150, ignore_eos=True)
        if i % 4 == 3:
            params = SamplingParams(max_new_tokens=150, ignore_eos=True, temperature=1.0, seed=i)
        specs.append((prompt, params, ["ddtree", "dflash", "ar"][i % 3]))
    got = run(e, specs)
    solo = [run(probe, [spec])[0] for spec in specs]
    assert e.num_preemptions > 0
    assert got == solo
    assert all(len(tokens) == 150 for tokens in got)
    assert_pool_whole(e)


def test_every_block_comes_back_after_aborts(models):
    """200 requests, a third aborted at a random moment (waiting, prefilled, decoding, preempted): the
    pool ends whole."""
    rng = random.Random(0)
    probe = engine(models)
    per_request = -(-(12 + 40 + probe.runner.drafter.block_size) // 16)
    e = engine(
        models, kv_cache_memory=4 * per_request * probe.runner.block_bytes, max_num_seqs=6, max_model_len=64
    )
    live: list[str] = []
    for i in range(200):
        # seeded: the same run every time (unseeded, some runs finished early enough never to preempt)
        params = SamplingParams(max_new_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 1.0]), seed=i)
        prompt = tokens(rng.randint(1, 12), salt=rng.randrange(100))
        live.append(e.add_request(prompt, params, method=rng.choice(["ddtree", "dflash", "ar"])))
        if rng.random() < 0.35:
            e.abort(live.pop(rng.randrange(len(live))))
        for d in e.step():
            if d.finish_reason is not None and d.request_id in live:
                live.remove(d.request_id)
    while e.has_unfinished_requests():
        e.step()
    assert e.num_preemptions > 0
    assert_pool_whole(e)


def test_a_long_prompt_is_prefilled_in_chunks_between_the_rounds_of_running_streams(models):
    """While 8 streams decode, a 3,000-token prompt arrives: its prefill takes several steps, and no
    stream waits more than two steps between tokens. Its output equals an unchunked prefill's."""
    long_prompt = tokens(3000)
    greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)
    whole = engine(models, max_model_len=4096, max_num_batched_tokens=4096)
    reference = run(whole, [(long_prompt, greedy, "ddtree")])[0]
    e = engine(models, max_model_len=4096, max_num_batched_tokens=512)
    params = SamplingParams(max_new_tokens=300, ignore_eos=True)
    streams = [e.add_request(PROMPTS[i % 3], params) for i in range(8)]
    while e.scheduler.waiting or any(r.prefilling for r in e.running):
        e.step()
    e.step()  # a round: every stream has just had tokens
    prefill, chunks = e.runner.prefill, []

    def spy(batch, tables, **options):
        chunks.append(sum(len(ids) for ids, _ in batch))
        return prefill(batch, tables, **options)

    e.runner.prefill = spy
    long_id = e.add_request(long_prompt, greedy)
    last, worst, step, got = dict.fromkeys(streams, 0), 0, 0, []
    while not got:  # until the long prompt's prefill ends with its first token
        step += 1
        for d in e.step():
            if d.request_id == long_id:
                assert d.error is None, d.error
                got += d.token_ids
            elif d.token_ids:
                worst, last[d.request_id] = max(worst, step - last[d.request_id]), step
    assert len(chunks) >= 3000 // 512 and max(chunks) <= 512  # the prompt took several steps
    assert worst <= 2 and all(step - s <= 2 for s in last.values())
    while e.has_unfinished_requests():
        got += [t for d in e.step() if d.request_id == long_id for t in d.token_ids]
    assert got == reference


def test_while_streams_decode_a_prefill_step_takes_what_a_few_rounds_time_prefills(models):
    """The engine's measured averages set the chunk (4 rounds of 10 ms at 0.5 ms a token: 80 tokens); the
    scheduler cuts a long prompt to it only while requests decode, and to the token budget otherwise."""
    e = engine(models, prefill_gap_rounds=4, max_model_len=512, max_num_batched_tokens=256)
    pacer = e.core.pacer
    pacer.round_seconds, pacer.token_seconds = 0.010, 0.0005
    pacer.pace()
    assert e.scheduler.decode_chunk == 80
    alone = e.add_request(tokens(300), SamplingParams(max_new_tokens=4))
    assert [c.tokens for c in e.scheduler.schedule_prefill()] == [256]  # nothing decodes: the whole budget
    e.abort(alone)
    e.step()
    e.add_request(tokens(20), SamplingParams(max_new_tokens=50))
    e.step()  # its prefill; it decodes from now on
    e.step()  # a round: the next step may prefill
    e.add_request(tokens(300, salt=1), SamplingParams(max_new_tokens=4))
    pacer.round_seconds, pacer.token_seconds = 0.010, 0.0005  # the steps above measured this machine
    pacer.pace()
    assert [c.tokens for c in e.scheduler.schedule_prefill()] == [80]
    e.scheduler.decode_chunk = 4  # never below one KV block a step: the pacer's floor
    pacer.token_seconds = 1.0
    pacer.pace()
    assert e.scheduler.decode_chunk == e.blocks.block_size
