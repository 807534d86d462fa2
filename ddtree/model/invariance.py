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
  span), and on the other queries of the call (1 to 21 of 8-200 queries of a causal block differ from the
  same query alone). So every exact query attends as plain decoding's does: the only query of its call,
  its visible columns in order (the committed ones, then for a tree node its root-to-node path), padded
  with masked columns to a width of its own (``QUERY_COLS``), never the batch's. Queries of one width go
  as one batched call (``QueryGroup``): a prefill's positions over views of their row's keys, tree nodes
  over gathered copies.

With both, seeded ``ddtree`` / ``dflash`` emit seeded ``ar``'s tokens in bf16, alone and in any batch. The
price is paid only in forwards with an exact row: a second pass of the exact rows' linears where a call is
outside the probed sizes, and per layer one attention call per width, a tree row's nodes' columns copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ddtree.model.attention import attend

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
    key = (weight.device.type, weight.dtype, tuple(weight.shape), bias is not None)
    if key not in REGIMES:
        REGIMES[key] = probe(weight, bias)
    return REGIMES[key]


def probe(weight: torch.Tensor, bias: torch.Tensor | None) -> RowRegime:
    """Measure the widest regime starting at 1 or 2 rows: for each call size in ``PROBE_SIZES``, its first
    and last rows against the same rows alone (``lo`` copies). Kernels differ here: on one CPU (oneDNN,
    AMX) every call of 1-32 rows agrees and larger calls do not; on another (AVX-512 bf16) a one-row call
    differs from every larger call from K = 2,048 up, and calls of 2-512 rows all agree."""
    weight, bias = weight[:PROBE_OUTPUTS], None if bias is None else bias[:PROBE_OUTPUTS]
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(PROBE_SIZES[-1], weight.shape[1], generator=gen, device=weight.device, dtype=weight.dtype)
    best = RowRegime(1, 1)  # a row alone is its own reference
    for lo in (1, 2):

        def alone(i: int, lo: int = lo) -> torch.Tensor:
            return F.linear(x[i : i + 1].repeat(lo, 1), weight, bias)[0]

        hi = lo - 1
        for m in (m for m in PROBE_SIZES if m >= lo):
            out = F.linear(x[:m], weight, bias)
            if not (torch.equal(out[0], alone(0)) and torch.equal(out[m - 1], alone(m - 1))):
                break
            hi = m
        if hi >= lo and hi > best.hi:
            best = RowRegime(lo, hi)
    return best


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: RowRegime):
    """``F.linear`` of x [..., K] -> [..., N] in calls of ``rows.lo`` to ``rows.hi`` rows."""
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    parts = []
    for i in range(0, flat.shape[0], rows.hi):
        part = flat[i : i + rows.hi]
        short = rows.lo - part.shape[0]
        if short > 0:  # padded with copies of its last row, sliced off again
            part = torch.cat([part, part[-1:].repeat(short, 1)])
        parts.append(F.linear(part, weight, bias)[: part.shape[0] - max(short, 0)])
    return torch.cat(parts).view(*x.shape[:-1], weight.shape[0])


class InvariantLinear(TorchFunctionMode):
    """Every ``F.linear`` inside gives the exact rows the bits they would get alone.

    A call whose size is inside the weight's regime runs as it is. Otherwise an input whose leading
    dimension is the batch ([B, T, K]) runs as usual, then the ``rows``' share is recomputed in the regime's
    calls and written over it (the other rows keep the one fast call); any other input (the LM head over
    flattened nodes, an MoE expert's routed tokens) runs wholly in such calls."""

    def __init__(self, rows: torch.Tensor, batch: int) -> None:
        super().__init__()
        self.rows, self.batch = rows, batch  # rows: [E] indices into the batch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x, weight = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        rows = regime(weight, bias)
        if rows.lo <= x.numel() // x.shape[-1] <= rows.hi and x.is_contiguous():
            return F.linear(x, weight, bias)
        if x.dim() < 3 or x.shape[0] != self.batch:
            return chunked_linear(x, weight, bias, rows)
        out = F.linear(x, weight, bias)  # [B, T, N]
        out[self.rows] = chunked_linear(x[self.rows], weight, bias, rows)
        return out


# An exact query attends over its visible columns rounded up to a multiple of this (the rest masked): the
# one key length plain decoding and every other method use for it. On this CPU the fused kernel's bits
# depend on the key length even where the extra columns are masked (every padding of 32 or more columns
# measured), so the length is the query's own, never the batch's span.
QUERY_COLS = 16


def query_width(visible: int | torch.Tensor) -> int | torch.Tensor:
    """Columns a query with ``visible`` columns reads (a host int, or a tensor of them on the device)."""
    return -(-visible // QUERY_COLS) * QUERY_COLS


@dataclass
class QueryGroup:
    """Exact queries that read the same number of columns: one attention call, a query each."""

    width: int
    rows: torch.Tensor  # [G] each query's batch row
    queries: torch.Tensor  # [G] its index among the forward's queries
    seen: torch.Tensor  # [G, 1, 1, width] True = attend: its visible columns
    cols: torch.Tensor | None = None  # [G, width] the columns it reads in order (None: its row's first width)
    row: int = -1  # with cols None, the one row of the group
    take: torch.Tensor | None = None  # [G] the query's width is this group's (a tree node: device-known)


def tree_groups(exact: tuple[int, ...], starts: tuple[int, ...], anc: torch.Tensor) -> list[QueryGroup]:
    """A verify forward's exact rows (batch indices ``exact``, their committed lengths ``starts``; tree block
    anc [B, N, N]): node j reads its committed columns, then its root-to-node path, in order (a parent's
    node index is below its children's, so its ancestors in index order are its path). Its depth is on the
    device, so each row is computed at every width its nodes may have, each node keeping its own."""
    n, device = anc.shape[1], anc.device
    nodes = torch.arange(n, device=device)
    by_width: dict[int, list[tuple]] = {}
    for row, start in zip(exact, starts, strict=True):
        a = anc[row]  # [N, N]
        path = torch.where(a, nodes, nodes + n).argsort(dim=-1)  # [N, N]: its ancestors first, in order
        visible = start + a.sum(-1)  # [N]
        for width in sorted({query_width(start + k) for k in range(1, n + 1)}):
            c = torch.arange(width, device=device)
            rel = (c - start).clamp(0, n - 1)  # [W]
            at = start + path.gather(1, rel.expand(n, width))  # [N, W]
            cols = torch.where(c < start, c, torch.where(c < visible[:, None], at, 0))  # masked: column 0
            take = query_width(visible) == width  # [N]
            by_width.setdefault(width, []).append((row, cols, c < visible[:, None], take))
    groups = []
    for width, parts in by_width.items():
        rows = torch.cat([torch.full((n,), row, device=device) for row, *_ in parts])
        cols, seen, take = (torch.cat([part[i] for part in parts]) for i in (1, 2, 3))
        queries = nodes.repeat(len(parts))
        groups.append(QueryGroup(width, rows, queries, seen[:, None, None], cols, take=take))
    return groups


def prefill_groups(
    exact: tuple[int, ...], offsets: list[int], lengths: list[int], device
) -> list[QueryGroup]:
    """A prefill's exact rows (a chunk of ``lengths[e]`` tokens after ``offsets[e]`` cached columns): the
    query at position p reads columns 0..p; positions of a row that share a width go as one call."""
    groups = []
    for row, offset, length in zip(exact, offsets, lengths, strict=True):
        visible = offset + 1 + torch.arange(length, device=device)  # [L]
        widths = [query_width(offset + 1 + i) for i in range(length)]
        lo = 0
        while lo < length:
            width = widths[lo]
            hi = lo + widths[lo:].count(width)  # widths grow with i: a run
            queries = torch.arange(lo, hi, device=device)
            seen = torch.arange(width, device=device) < visible[lo:hi, None]  # [G, W]
            groups.append(
                QueryGroup(width, torch.full_like(queries, row), queries, seen[:, None, None], row=row)
            )
            lo = hi
    return groups


@dataclass
class ExactRows:
    """A forward's exact rows: the linear mode over them and the attention calls of their queries."""

    rows: torch.Tensor  # [E]
    indices: tuple[int, ...]  # the same rows, on the host
    batch: int
    groups: list[QueryGroup] = field(default_factory=list)

    def linear(self) -> InvariantLinear:
        return InvariantLinear(self.rows, self.batch)

    def attend(
        self,
        out: torch.Tensor,  # [B, heads, T, Dv]: the batch's attention, the exact queries' part overwritten
        q: torch.Tensor,  # [B, heads, T, D]
        keys: torch.Tensor,  # [B, kv_heads, span, D]
        values: torch.Tensor,  # [B, kv_heads, span, Dv]
        scale: float,
    ) -> torch.Tensor:
        """The exact queries' attention again, as plain decoding computes it: each the only query of its
        call, over its visible columns in order, at its own width (``QUERY_COLS``)."""
        for g in self.groups:
            size = len(g.queries)
            if g.cols is None:  # one row's positions over its first columns: views, not copies
                k, v = (fit(x[g.row : g.row + 1], g.width).expand(size, -1, -1, -1) for x in (keys, values))
            else:  # [G, kv_heads, W, D]: each node's columns gathered
                k, v = (x.transpose(1, 2)[g.rows[:, None], g.cols].transpose(1, 2) for x in (keys, values))
            res = attend(q[g.rows, :, g.queries][:, :, None], k, v, g.seen, scale)[:, :, 0]  # [G, heads, Dv]
            if g.take is not None:
                res = torch.where(g.take[:, None, None], res, out[g.rows, :, g.queries])
            out[g.rows, :, g.queries] = res
        return out


def fit(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [1, kv_heads, span, D] as its first ``width`` columns (zeros past the span: masked)."""
    if width <= x.shape[2]:
        return x[:, :, :width]
    return F.pad(x, (0, 0, 0, width - x.shape[2]))
