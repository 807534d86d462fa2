"""A round syncs with the host at most twice: everything from the draft to the verdicts stays on the device.

On an accelerator every host sync idles the device; on the CPU the same calls are what would sync. They
are counted with a ``TorchFunctionMode`` during one round of 16 rows: reads of a tensor on the host
(``tolist``, ``item``, ``cpu``, ``numpy`` and Python's ``bool`` / ``int`` / ``float`` / ``index`` of a
tensor), ops whose output size depends on the data (``nonzero``, boolean indexing, ``unique``...), and
blocking uploads (Python data onto a device, or a host tensor copied without ``non_blocking`` from pinned
memory: ``ddtree.model.capture.upload`` is the round's one way up). ``DDTREE_TEST_DEVICE=cuda`` runs the
engine on CUDA (``scripts/accelerator_check.sh`` also counts the syncs CUDA itself reports, with
``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import os
import traceback
from dataclasses import replace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ddtree import Engine, SamplingParams, StructuredOutputs
from ddtree.engine.verifier import Verifier
from tests.conftest import tiny_drafter, tiny_models, tiny_target

READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}
# Ops whose output size depends on the data: the host must wait for the values to size the result.
DATA_SIZED = {
    torch.nonzero,
    torch.Tensor.nonzero,
    torch.masked_select,
    torch.Tensor.masked_select,
    torch.unique,
    torch.Tensor.unique,
    torch.unique_consecutive,
    torch.argwhere,
}
# Python data onto a device: always from pageable memory, so the copy blocks.
FROM_PYTHON = {torch.tensor, torch.as_tensor, torch.asarray}


def sync_kind(func, args: tuple, kwargs: dict) -> str | None:
    """What host sync ``func(*args, **kwargs)`` makes, or None.

    An upload counts as blocking unless it is non-blocking from pinned memory; on the CPU, where nothing
    can be pinned, a non-blocking copy stands in for it (``capture.upload`` makes exactly these calls on
    CUDA). Device-to-device copies and dtype casts are not uploads."""
    if func in READS:
        return func.__name__
    if func in DATA_SIZED:
        return func.__name__
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "where(condition)"
    if func is torch.Tensor.__getitem__ and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in _indices(args[1])
    ):
        return "boolean index"
    if func is torch.repeat_interleave or func is torch.Tensor.repeat_interleave:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            return "repeat_interleave"
    if func in FROM_PYTHON and kwargs.get("device") is not None:
        return f"blocking upload ({func.__name__})"
    if func is torch.Tensor.to:
        src, device = args[0], _destination(args[1:], kwargs)
        if device is not None and src.device.type == "cpu" and not _async(src, device, args, kwargs):
            return "blocking upload (to)"
    if func is torch.Tensor.copy_:
        dst, src = args[0], args[1]
        if src.device.type == "cpu" and dst.device.type != "cpu":
            if not (_non_blocking(args[2:], kwargs) and src.is_pinned()):
                return "blocking upload (copy_)"
    return None


def _indices(index) -> tuple:
    return index if isinstance(index, tuple) else (index,)


def _destination(rest: tuple, kwargs: dict) -> torch.device | None:
    """The device a ``Tensor.to`` call names (a device, a string, or another tensor's), if any."""
    for value in (*rest, kwargs.get("device"), kwargs.get("other")):
        if isinstance(value, (torch.device, str)):
            return torch.device(value)
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _non_blocking(rest: tuple, kwargs: dict) -> bool:
    return bool(kwargs.get("non_blocking")) or any(v is True for v in rest)


def _async(src: torch.Tensor, device: torch.device, args: tuple, kwargs: dict) -> bool:
    if not _non_blocking(args[1:], kwargs):
        return False
    return device.type == "cpu" or src.is_pinned()


def call_site() -> traceback.FrameSummary:
    """The innermost frame outside torch and the counter: the line that made the call."""
    for frame in reversed(traceback.extract_stack()):
        if f"{os.sep}torch{os.sep}" not in frame.filename and frame.name not in (
            "__torch_function__",
            "call_site",
        ):
            return frame
    raise AssertionError("no caller outside torch")


def where(frame: traceback.FrameSummary) -> str:
    return f"{'/'.join(frame.filename.rsplit(os.sep, 2)[-2:])}:{frame.lineno}"


class HostSyncs(TorchFunctionMode):
    """Counts the host syncs made under it, by kind: reads of device values, data-sized ops, blocking
    uploads."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = sync_kind(func, args, kwargs)
        if kind is not None:
            site = call_site()
            # On the CPU every tensor is a host tensor, so a ``.to(device)`` of a device tensor (a no-op on
            # CUDA, as transformers' rotary embeddings make) looks like an upload: only uploads written
            # here count (ddtree, tests), and ddtree never moves a tensor already on the device.
            if not kind.startswith("blocking upload") or "site-packages" not in site.filename:
                self.calls.append(f"{kind} at {where(site)}")
        return func(*args, **kwargs)


SAMPLED = [
    SamplingParams(temperature=0.8, max_new_tokens=64, seed=1),
    SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=64, seed=2),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.95, max_new_tokens=64, seed=3),
    SamplingParams(temperature=1.0, min_p=0.05, max_new_tokens=64, seed=4),
]


DEVICE = os.environ.get("DDTREE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def engine() -> Engine:
    target = tiny_target()
    drafter = tiny_drafter(target)
    return Engine(target.to(DEVICE), drafter.to(DEVICE), max_num_seqs=16, budget=16)


def reads_in_one_round(engine: Engine, params: list[SamplingParams], methods: list[str]) -> list[str]:
    ids = [
        engine.add_request([5 + i, 9, 3 + i % 4], p, method=m)
        for i, (p, m) in enumerate(zip(params, methods, strict=True))
    ]
    while engine.scheduler.waiting or any(r.prefilling for r in engine.running):
        engine.step()  # prefill (its own step; the first token is read there)
    engine.step()  # one warm round: lazy initialisation is not the round's cost
    assert engine.num_running == 16 and not engine.scheduler.waiting
    with HostSyncs() as reads:
        engine.step()
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    return reads.calls


@pytest.mark.parametrize("kind", ["greedy", "sampled", "mixed"])
def test_one_round_of_sixteen_rows_reads_the_host_at_most_twice(engine, kind):
    greedy = SamplingParams(max_new_tokens=64)
    params = {
        "greedy": [greedy] * 16,
        "sampled": [SAMPLED[i % 4] for i in range(16)],
        "mixed": [greedy if i % 2 else SAMPLED[i % 4] for i in range(16)],
    }[kind]
    methods = ["ddtree"] * 12 + ["dflash", "dflash", "ar", "ar"]  # every tree shape in one batch
    calls = reads_in_one_round(engine, params, methods)
    assert 1 <= len(calls) <= 2, "\n".join(calls)  # at least the verdicts: the counter sees reads


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_a_fixed_shape_round_reads_only_its_verdicts(kind):
    """With fixed shapes the acceptance takes the node bucket's depth bound in steps instead of reading the
    trees' depth: a round of greedy rows, or of sampled rows, makes one host read."""
    target = tiny_target()
    engine = Engine(
        target.to(DEVICE), tiny_drafter(target).to(DEVICE), max_num_seqs=16, budget=16, fixed_shapes=True
    )
    params = (
        [SamplingParams(max_new_tokens=64)] * 16 if kind == "greedy" else [SAMPLED[i % 4] for i in range(16)]
    )
    calls = reads_in_one_round(engine, params, ["ddtree"] * 12 + ["dflash", "dflash", "ar", "ar"])
    assert len(calls) == 1 and "engine/verifier.py" in calls[0], "\n".join(calls)  # the verdicts


def test_the_counter_catches_an_inserted_read_and_an_inserted_blocking_upload(engine, monkeypatch):
    """The bound above is only as good as the counter: a stray ``.item()`` and a ``torch.tensor(...,
    device=)`` slipped into the round are each counted, where they were made."""
    accept = Verifier.accept

    def sloppy(self, rows, trees, hidden, padded=None):
        torch.tensor([len(rows)], device=hidden.device)  # Python data onto the device: blocks
        torch.from_numpy(trees.sizes).to(hidden.device)  # pageable, blocking
        trees.tokens.sum().item()  # a read
        return accept(self, rows, trees, hidden, padded)

    monkeypatch.setattr(Verifier, "accept", sloppy)
    calls = reads_in_one_round(engine, [SamplingParams(max_new_tokens=64)] * 16, ["ddtree"] * 16)
    here = "tests/test_host_syncs.py:"
    inserted = [c for c in calls if here in c]
    assert [c.split(" at ")[0] for c in inserted] == [
        "blocking upload (tensor)",
        "blocking upload (to)",
        "item",
    ], calls
    assert 1 <= len(calls) - len(inserted) <= 2, calls


def test_data_sized_ops_and_async_uploads_are_told_apart():
    x = torch.arange(6)
    cases = {
        "nonzero": lambda: x.nonzero(),
        "boolean index": lambda: x[x > 2],
        "where(condition)": lambda: torch.where(x > 2),
        "repeat_interleave": lambda: torch.repeat_interleave(x, x),
    }
    for kind, op in cases.items():
        with HostSyncs() as syncs:
            op()
        assert [c.split(" at ")[0] for c in syncs.calls] == [kind]
    with HostSyncs() as syncs:
        x[torch.tensor([1, 2])]  # integer index: sized by the index, no sync
        torch.repeat_interleave(x, x, output_size=15)
        torch.where(x > 2, x, 0)
        x.to(torch.float32)  # a cast, not an upload
        x.to("cpu", non_blocking=True)  # the CPU's stand-in for a pinned async copy
    assert syncs.calls == []


def test_structured_output_rows_add_one_read_of_their_trees_and_no_blocking_upload():
    """A constrained row's masks need its tree on the host (one copy, for all such rows), and nothing else:
    the masks and their row indices go up pinned, like every upload of the round."""
    tokenizer, target, drafter = tiny_models()
    engine = Engine(target.to(DEVICE), drafter.to(DEVICE), tokenizer, max_num_seqs=16, budget=16)
    spec = StructuredOutputs(regex="[a-z ]{1,80}")
    greedy = SamplingParams(max_new_tokens=48)
    constrained = SamplingParams(max_new_tokens=48, structured_outputs=spec)
    sampled = [replace(p, max_new_tokens=48) for p in SAMPLED]
    params = [constrained if i % 4 == 0 else greedy if i % 2 else sampled[i % 4] for i in range(16)]
    methods = ["ddtree"] * 12 + ["dflash", "dflash", "ar", "ar"]
    calls = reads_in_one_round(engine, params, methods)
    # request/grammar.py only ever holds host data (the trees' copy, xgrammar's bitmasks): its
    # conversions look like reads to this counter on the CPU, where every tensor is a host tensor.
    calls = [c for c in calls if "request/grammar.py" not in c]
    assert not [c for c in calls if c.startswith("blocking upload")], calls
    assert len(calls) == 3 and any("verifier.py" in c and c.startswith("cpu") for c in calls), calls


def test_penalised_rows_add_no_read_and_no_blocking_upload(engine):
    """Penalties (counts, bias, min_tokens) are per-row state uploaded pinned and node-wise tensor ops: a
    round with penalised rows, greedy and sampled, drafted and verified, still reads the host at most
    twice. (Multi-token bad words, like grammars, copy their rows' trees once: not asked here.)"""
    penalised = dict(frequency_penalty=0.5, presence_penalty=0.2, repetition_penalty=1.3, logit_bias={3: 1.0})
    greedy = SamplingParams(max_new_tokens=64, min_tokens=40, **penalised)
    sampled = [replace(p, **penalised) for p in SAMPLED]
    params = [greedy if i % 2 else sampled[i % 4] for i in range(16)]
    methods = ["ddtree"] * 12 + ["dflash", "dflash", "ar", "ar"]
    calls = reads_in_one_round(engine, params, methods)
    assert not [c for c in calls if c.startswith("blocking upload")], calls
    assert 1 <= len(calls) <= 2, "\n".join(calls)
