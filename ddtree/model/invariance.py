"""Batch-invariant computation for exact rows: a row whose result must not depend on the rows beside it, on
the method, or on where its tree put its columns (a seeded request in bf16: issue 44).

In low precision three things make a row's logits depend on its company (measured in bf16 on two CPUs,
oneDNN's AMX kernels and AVX-512 bf16 ones, ``docs/benchmarks.md``):

- A linear layer's kernel, and so its reduction order, changes with the call's row count, at sizes that
  depend on the machine and the weight's shape (``probe``). ``InvariantLinear`` runs the exact rows' share
  of every linear in calls whose sizes the probe measured to agree bit for bit (vLLM's batch-invariant
  mode fixes its matmul tiles for the same reason).
- Attention's bits depend on where a query's columns sit (a tree node's ancestors among masked siblings
  group their sums differently), on how many columns the call reads, masked ones included (the batch's
  span), and on the other queries of the call. A layout that mimics plain decoding's call (one query per
  call over its own columns, as built first) costs a fused kernel's per-call overhead per query: 7.7x an
  unseeded round on this CPU. So exact rows attend in float64 instead (``exact_attention``), where the
  order of a sum no longer reaches a bf16 result, in one batched call per layer over the batch's layout.

MLA's exact rows take one float64 absorbed form (``exact_latent_attention``) in a prefill and a verify
round alike, where the batch's bf16 forms differ (a prefill expands keys, a verify absorbs W_UK).

With both, seeded ``ddtree`` / ``dflash`` emit seeded ``ar``'s tokens in bf16, alone and in any batch. The
price is paid only in forwards with an exact row: a second pass of the exact rows' linears where a call is
outside the probed sizes, and their attention once more in float64.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ddtree.model.precision import HALF_PRECISION

# Call sizes the probe tries: every size to 40, then around each power of two to 256 (where kernels switch
# tiles), 256 being the largest chunk an exact row's linear is split into.
PROBE_SIZES = (*range(1, 41), 48, 63, 64, 65, 96, 127, 128, 129, 192, 255, 256)
# Output features the probe computes: a head of 151,936 has the regime of its first 4,096 or 16,384
# (measured, K 1,024-4,096: an output's reduction runs over K, the outputs only split among threads), at a
# ninth of the probe's time (8.6 -> 1.0 s at K = 1,024).
PROBE_OUTPUTS = 16384


@dataclass(frozen=True)
class RowRegime:
    """Linear calls of ``lo`` to ``hi`` rows give each row the same bits, whatever the rows beside it and its
    place among them: an exact row's share runs in such calls (chunks of at most ``hi``, a shorter one
    padded to ``lo`` with copies)."""

    lo: int
    hi: int


REGIMES: dict[tuple, RowRegime] = {}  # (device type, dtype, weight shape, bias) -> its measured regime


def regime(weight: torch.Tensor, bias: torch.Tensor | None) -> RowRegime:
    """This kernel's regime for ``weight``'s shape, measured at its first exact call (``probe``)."""
    key = (weight.device.type, weight.dtype, weight.shape, bias is not None)
    if key not in REGIMES:
        REGIMES[key] = probe(weight, bias)
    return REGIMES[key]


def probe(weight: torch.Tensor, bias: torch.Tensor | None) -> RowRegime:
    """Measure the widest regime starting at 2 rows, or at 1 where it is wider: for each call size in
    ``PROBE_SIZES``, every row of the call against the same row alone (``lo`` copies). Kernels differ
    here: on one CPU (oneDNN, AMX) every call of 1-32 rows agreed and larger calls did not; on another
    (AVX-512 bf16) a one-row call differs from larger ones, for some rows and shapes only (a matrix-vector
    kernel against a matrix one: seen at K = 32 for 1 row in 300, at K >= 2,048 for most), while calls of
    2-256 rows all agree. So 2 is preferred: a one-row regime that a probe's rows happen to pass can fail
    on other data (it did, K = 32, at 132 rows and up)."""
    weight, bias = weight[:PROBE_OUTPUTS], None if bias is None else bias[:PROBE_OUTPUTS]
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(PROBE_SIZES[-1], weight.shape[1], generator=gen, device=weight.device, dtype=weight.dtype)
    best = RowRegime(1, 1)  # a row alone is its own reference
    for lo in (2, 1):
        alone = torch.stack([F.linear(x[i : i + 1].repeat(lo, 1), weight, bias)[0] for i in range(len(x))])
        hi = lo - 1
        for m in (m for m in PROBE_SIZES if m >= lo):
            if not torch.equal(F.linear(x[:m], weight, bias), alone[:m]):
                break
            hi = m
        if hi >= lo and hi > best.hi:
            best = RowRegime(lo, hi)
    return best


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: RowRegime):
    """``F.linear`` of x [..., K] -> [..., N] in calls of ``rows.lo`` to ``rows.hi`` rows (a short one padded
    with copies of its last row, sliced off again)."""
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    m = flat.shape[0]
    if m <= rows.hi:  # one call: a decode step, a tree, a short chunk
        if m < rows.lo:
            flat = torch.cat((flat, flat[-1:].expand(rows.lo - m, -1)))
        return F.linear(flat, weight, bias)[:m].view(*x.shape[:-1], weight.shape[0])
    parts = []
    for i in range(0, m, rows.hi):
        part = flat[i : i + rows.hi]
        short = rows.lo - part.shape[0]
        if short > 0:
            part = torch.cat((part, part[-1:].expand(short, -1)))
        parts.append(F.linear(part, weight, bias)[: part.shape[0] - max(short, 0)])
    return torch.cat(parts).view(*x.shape[:-1], weight.shape[0])


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, exact: ExactRows
) -> torch.Tensor:
    """``F.linear`` that gives the batch's exact rows the bits they would get alone.

    A call whose size is inside the weight's regime runs as it is. Otherwise an input whose leading
    dimension is the batch ([B, T, K]) runs as usual, then the rows' share is recomputed in the regime's
    calls and written over it (the other rows keep the one fast call); any other input (the LM head over
    flattened nodes, an MoE expert's routed tokens), or one whose rows are all exact (a seeded decode alone:
    the usual call would be thrown away), runs wholly in such calls."""
    regime_ = regime(weight, bias)
    if regime_.lo <= x.numel() // x.shape[-1] <= regime_.hi and x.is_contiguous():
        return F.linear(x, weight, bias)
    if x.dim() < 3 or x.shape[0] != exact.batch or exact.whole:
        return chunked_linear(x, weight, bias, regime_)
    out = F.linear(x, weight, bias)  # [B, T, N]
    out[exact.rows] = chunked_linear(x[exact.rows], weight, bias, regime_)
    return out


class InvariantLinear(TorchFunctionMode):
    """Every ``F.linear`` inside runs as ``invariant_linear`` (for code that calls it directly: the verdicts'
    LM head, an MoE's experts and router). The mode sees every op, so a target's forward instead reaches
    its linears through ``install``."""

    def __init__(self, exact: ExactRows) -> None:
        super().__init__()
        self.exact = exact

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        return invariant_linear(args[0], args[1], bias, self.exact)


ACTIVE: list[ExactRows] = []  # the exact rows of the forward now running (``active``), innermost last


@contextlib.contextmanager
def active(exact: ExactRows):
    """Within, the modules ``install`` routed give ``exact``'s rows their bits alone."""
    ACTIVE.append(exact)
    try:
        yield
    finally:
        ACTIVE.pop()


def install(model: nn.Module) -> None:
    """Route ``model``'s linears through ``invariant_linear`` while a forward holds exact rows (``active``):
    each ``nn.Linear`` gets a forward that checks for them, and each other module with matrices of its own
    (an MoE's fused experts and router call ``F.linear`` on them; not a norm's vector, not an embedding)
    runs under ``InvariantLinear`` then. Outside ``active`` they compute what they did. A
    ``TorchFunctionMode`` over the whole forward did the same at a Python call per op (a seeded c = 1
    decode ran at 0.51x an unseeded one on the built-in pair). Idempotent (engines may share a model)."""
    for m in model.modules():
        if getattr(m, "_exact_routed", False):
            continue
        if isinstance(m, nn.Linear):
            m.forward = types.MethodType(_linear_forward, m)
        elif not isinstance(m, nn.Embedding) and any(p.dim() > 1 for p in m.parameters(recurse=False)):
            m.forward = _moded(m.forward)
        m._exact_routed = True


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not ACTIVE:
        return F.linear(x, self.weight, self.bias)
    return invariant_linear(x, self.weight, self.bias, ACTIVE[-1])


def _moded(forward):
    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        if not ACTIVE:
            return forward(*args, **kwargs)
        with ACTIVE[-1].linear():
            return forward(*args, **kwargs)

    return wrapped


# What one float64 pass of exact attention holds, whatever the rows, heads and context: its keys and values
# (or latents) in float64, at most EXACT_BYTES, and its scores, at most EXACT_SCORES entries, computed in
# place; SCORE_COPIES counts them with what grows with them (the queries in float64, the weighted values and
# their running sum: each at most a score tensor's size while a chunk's columns outnumber a head's
# dimensions, and the mask's complement). A longer context goes in column chunks
# (an online softmax in float64), more queries in query chunks, so seeded rows at 40,960 columns cost a
# bounded scratch, not their whole context in float64 (16 rows of Qwen3-0.6B's shapes: 10.7 GB);
# ``exact_scratch_bytes`` is what the memory plan reserves for it. Smaller column chunks let more queries
# share a pass: a long prefill converts its keys once per query chunk.
EXACT_BYTES = 1 << 25
EXACT_SCORES = 1 << 22
SCORE_COPIES = 4


def exact_scratch_bytes(dtype: torch.dtype, weight_values: int = 0) -> int:
    """Bytes a forward's exact rows may hold beyond its own activations, for a model computing in
    ``dtype`` (none in float32: no row is exact there) whose exact pass converts a weight of
    ``weight_values`` values to float64 (MLA's kv_b_proj: Kimi K2's is 67 MB so)."""
    if dtype not in HALF_PRECISION:
        return 0
    return EXACT_BYTES + SCORE_COPIES * 8 * EXACT_SCORES + 8 * weight_values


# Query rows up to which the scores are computed as keys @ q^T. MKL's float64 GEMM with two rows (a decode
# step's queries of one KV head) runs far below its speed with many: one thread, 32 heads x 900 columns x
# 64, 2.4 ms as q @ keys^T against 0.88 ms as keys @ q^T; 8 rows 3.5 against 2.1; 34 rows (a 17-node tree)
# 5.7 against 7.6. (Float32 GEMM does the same work in 0.3 ms: the float64 kernels, not memory, cost here.)
# The whole exact call, 16 rows over 900 columns, the other way round / keys first: 2 query rows 7.0 / 5.9
# ms, 4 rows 7.5 / 7.0, 8 rows 8.9 / 8.5, 12 rows 9.5 / 11.1 (the transposed scores cost the later ops).
KEYS_FIRST_ROWS = 8


def column_chunk(rows: int, per_column: int, columns: int) -> int:
    """Columns per float64 pass of ``rows`` rows whose keys and values take ``per_column`` values a column:
    at most ``EXACT_BYTES`` of them, and no more than the ``columns`` there are."""
    return min(columns, max(1, EXACT_BYTES // (8 * rows * per_column)))


def query_chunk(rows: int, heads: int, columns: int) -> int:
    """Queries per float64 pass of ``rows`` rows over ``columns`` columns: scores of at most
    ``EXACT_SCORES`` entries."""
    return max(1, EXACT_SCORES // max(1, rows * heads * columns))


Chunk = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def attend64(
    q: torch.Tensor,  # [E, kv, R, D] float64: query rows (a KV head's queries, its heads folded in)
    chunk: Chunk,  # (lo, hi) -> float64 keys [E, kv, W, D] and values [E, kv, W, Dv] of columns lo .. hi
    columns: int,
    width: int,  # columns per pass
    seen: torch.Tensor,  # bool [E, 1, R, columns]: True = attend
    scale: float,
) -> torch.Tensor:
    """Masked softmax attention in float64, [E, kv, R, Dv], the one computation both exact forms run: over
    ``width`` columns at a time with an online softmax (each query's running max, sum and weighted values,
    rescaled as a later chunk raises the max). Every query sees at least one column (its own)."""
    top = total = acc = None
    for lo in range(0, columns, width):
        keys, values = chunk(lo, lo + width)
        if q.shape[-2] <= KEYS_FIRST_ROWS:  # [E, kv, R, W], as keys @ q^T: GEMM's long side is the columns
            scores = torch.matmul(keys, q.transpose(-1, -2)).transpose(-1, -2)
        else:
            scores = torch.matmul(q, keys.transpose(-1, -2))
        scores.mul_(scale).masked_fill_(~seen[..., lo : lo + width], float("-inf"))
        new_top = scores.amax(dim=-1, keepdim=True)  # [E, kv, R, 1]; -inf: nothing seen in this chunk
        if top is not None:
            new_top = torch.maximum(new_top, top)
        shift = new_top.masked_fill(new_top == float("-inf"), 0.0)  # exp(-inf - 0) = 0, not NaN
        weights = scores.sub_(shift).exp_()  # [E, kv, R, W]: masked columns exactly 0
        part, part_total = torch.matmul(weights, values), weights.sum(dim=-1, keepdim=True)
        if top is None:
            total, acc = part_total, part
        else:
            rescale = torch.exp(top - shift)  # [E, kv, R, 1]: 0 where nothing was seen before
            total, acc = total * rescale + part_total, acc * rescale + part
        top = new_top
    return acc / total


def exact_attention(
    q: torch.Tensor,  # [B, heads, T, D]
    keys: torch.Tensor,  # [B, kv_heads, S, D]
    values: torch.Tensor,  # [B, kv_heads, S, Dv]
    mask: torch.Tensor,  # [B, 1, T, S] bool, True = attend
    scale: float,
    rows: torch.Tensor | None = None,  # [E] the exact rows of the batch; None: all of them
) -> torch.Tensor:
    """Attention [E, heads, T, Dv] of the exact rows in float64, rounded back to q's dtype: a query's result
    depends only on its visible keys and values, not on where they sit, what lies masked between them or
    what else the call holds. A product of two bf16 (or fp16) values is exact in float64 and a dot
    product's sum is within 2^-53 of exact in any order, so the order a kernel adds in (or the chunks a
    pass splits the columns into) moves a score by ~1e-16, and the output's rounding to bf16 (2^-8) hides
    that in all but ~2^-45 of entries (none seen: the tests compare tree layouts, spans, chunkings and
    batches against each query computed alone). Masked columns get exactly zero weight (exp(-inf)). No
    kernel choice is trusted to keep its reduction order: the invariance is the precision's, on any
    device."""
    if rows is not None:
        q, mask = q[rows], mask[rows]
    e, heads, t, d = q.shape
    kv, columns = keys.shape[1], keys.shape[2]
    group = heads // kv
    width = column_chunk(e, kv * (d + values.shape[-1]), columns)
    chunk = float64_columns(keys, values, rows, width >= columns)
    step = query_chunk(e, heads, width)
    parts = []
    for lo in range(0, t, step):
        qc = q[:, :, lo : lo + step].double()  # [E, heads, C, D]
        c = qc.shape[2]
        # the heads sharing a KV head fold into its query rows: [E, kv, group * C, D], row g * C + i
        seen = mask[:, :, None, lo : lo + step].expand(e, 1, group, c, -1).reshape(e, 1, group * c, -1)
        out = attend64(qc.reshape(e, kv, group * c, d), chunk, columns, width, seen, scale)
        parts.append(out.view(e, heads, c, -1).to(q.dtype))  # [E, heads, C, Dv]
    return torch.cat(parts, dim=2)


def float64_columns(
    keys: torch.Tensor, values: torch.Tensor | int, rows: torch.Tensor | None, once: bool
) -> Chunk:
    """``attend64``'s chunks of ``keys`` / ``values`` [B, kv, S, D] (the exact ``rows`` of them): each a
    contiguous float64 copy (a strided one, the pool's [B, span, kv, D] read transposed, made every matmul
    copy it again: 10 ms against 1.9 ms for 16 decode rows over 320 columns). ``values`` an int: the values
    are the keys' first that many dimensions (MLA's latents, copied once). ``once``: every column in one
    chunk, converted once for all query chunks."""

    def convert(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = keys[:, :, lo:hi] if rows is None else keys[rows, :, lo:hi]
        k = contiguous64(k, "keys")
        if isinstance(values, int):
            return k, k[..., :values]
        v = values[:, :, lo:hi] if rows is None else values[rows, :, lo:hi]
        return k, contiguous64(v, "values")

    if once:
        whole = convert(0, keys.shape[2])
        return lambda lo, hi: whole
    return convert


SCRATCH: dict[tuple, torch.Tensor] = {}  # (device, slot, inference mode) -> a float64 buffer, grown


def contiguous64(x: torch.Tensor, slot: str) -> torch.Tensor:
    """x as a contiguous float64 tensor, in one copy into ``slot``'s buffer (valid until its next use).
    Kept, as the cache's read buffers are: a fresh 8 MB tensor a layer (16 rows, 470 columns) went back
    to the system and faulted its pages in again every layer, the exact path's largest and least steady
    cost on a CPU. At most ``EXACT_BYTES`` across both slots (``column_chunk``)."""
    # a buffer made under inference mode cannot be written outside it: one per mode
    key, n = (x.device, slot, torch.is_inference_mode_enabled()), x.numel()
    buf = SCRATCH.get(key)
    if buf is None or buf.numel() < n:
        SCRATCH.pop(key, None)  # the old buffer goes before the new one is made
        buf = SCRATCH[key] = torch.empty(n, dtype=torch.float64, device=x.device)
    return buf[:n].view(x.shape).copy_(x)


def exact_latent_attention(
    q_nope: torch.Tensor,  # [B, heads, T, nope]
    q_rot: torch.Tensor,  # [B, heads, T, rope], rotated
    latent: torch.Tensor,  # [B, S, rank + rope]: the cached latents
    w: torch.Tensor,  # [heads, nope + v, rank]: kv_b_proj's weight (W_UK its first nope rows, W_UV the rest)
    mask: torch.Tensor,  # [B, 1, T, S] bool, True = attend
    scale: float,
    rows: torch.Tensor | None = None,  # [E] the exact rows of the batch; None: all of them
) -> torch.Tensor:
    """MLA attention [E, heads, T, v] of the exact rows in float64 in the absorbed form, rounded to q's
    dtype: the one form both a prefill (which expands keys in bf16) and a verify round (which absorbs W_UK
    in bf16) give their exact rows, so a position gets the same bits whichever forward computed it
    (``exact_attention``'s argument, W_UK and W_UV inside the float64 pass)."""
    if rows is not None:
        q_nope, q_rot, mask = q_nope[rows], q_rot[rows], mask[rows]
    e, heads, t, nope = q_nope.shape
    rank, columns = w.shape[2], latent.shape[1]
    w = w.double()
    width = column_chunk(e, latent.shape[2], columns)
    # [B, 1, S, rank + rope]: one KV head, whose values are the latents' first ``rank`` dimensions
    chunk = float64_columns(latent[:, None], rank, rows, width >= columns)
    step = query_chunk(e, heads, width)
    parts = []
    for lo in range(0, t, step):
        q_lat = per_head(q_nope[:, :, lo : lo + step].double(), w[:, :nope])  # [E, heads, C, rank]
        q = torch.cat((q_lat, q_rot[:, :, lo : lo + step].double()), dim=-1)  # [E, heads, C, rank + rope]
        c = q.shape[2]
        seen = mask[:, :, None, lo : lo + step].expand(e, 1, heads, c, -1).reshape(e, 1, heads * c, -1)
        out = attend64(q.reshape(e, 1, heads * c, -1), chunk, columns, width, seen, scale)
        out = out.view(e, heads, c, rank)  # in the latent space
        parts.append(per_head(out, w[:, nope:].transpose(1, 2)).to(q_nope.dtype))  # [E, heads, C, v]
    return torch.cat(parts, dim=2)


def per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [E, heads, C, K] @ w [heads, K, N] -> [E, heads, C, N] as one matmul per head over E * C rows.
    ``torch.matmul`` broadcasting E over w copies w once per row (Kimi K2's W_UK in float64: 33 MB a row,
    +131 MiB at 4 rows)."""
    e, heads, c, k = x.shape
    out = torch.matmul(x.transpose(0, 1).reshape(heads, e * c, k), w)  # [heads, E * C, N]
    return out.view(heads, e, c, -1).transpose(0, 1)


@dataclass
class ExactRows:
    """A forward's exact rows: the linear mode over them and their attention (``exact_attention``)."""

    rows: torch.Tensor  # [E]
    batch: int

    def linear(self) -> InvariantLinear:
        return InvariantLinear(self)

    @property
    def whole(self) -> bool:
        """Every row of the batch is exact: the batch's own linear and attention calls can be skipped."""
        return self.rows.shape[0] == self.batch

    def attend(
        self,
        out: torch.Tensor | None,  # [B, heads, T, Dv]: the batch's attention (exact rows overwritten); None
        # when ``whole``
        q: torch.Tensor,  # [B, heads, T, D]
        keys: torch.Tensor,  # [B, kv_heads, span, D]
        values: torch.Tensor,  # [B, kv_heads, span, Dv]
        mask: torch.Tensor,  # [B, 1, T, span] bool
        scale: float,
    ) -> torch.Tensor:
        """The exact rows' attention again, computed so that no layout or company reaches its bits."""
        if out is None:
            return exact_attention(q, keys, values, mask, scale)
        out[self.rows] = exact_attention(q, keys, values, mask, scale, self.rows)
        return out

    def attend_latent(
        self,
        out: torch.Tensor | None,  # [B, heads, T, v]: the batch's MLA attention, exact rows overwritten;
        # None when ``whole``
        q_nope: torch.Tensor,  # [B, heads, T, nope]
        q_rot: torch.Tensor,  # [B, heads, T, rope]
        latent: torch.Tensor,  # [B, S, rank + rope]
        w: torch.Tensor,  # [heads, nope + v, rank]
        mask: torch.Tensor,  # [B, 1, T, S] bool
        scale: float,
    ) -> torch.Tensor:
        """MLA's exact rows again (``exact_latent_attention``), in a prefill and a verify round alike."""
        if out is None:
            return exact_latent_attention(q_nope, q_rot, latent, w, mask, scale)
        out[self.rows] = exact_latent_attention(q_nope, q_rot, latent, w, mask, scale, self.rows)
        return out
