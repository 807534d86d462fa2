"""Batch-invariant computation for exact rows: a row whose result must not depend on the rows beside it, on
the method, or on where its tree put its columns (a seeded request: issue 44; every row with
``deterministic``).

In low precision two things make a row's logits depend on its company (measured on this CPU, bf16,
oneDNN's AMX kernels, ``docs/benchmarks.md``):

- A linear layer's kernel, and so its reduction order, changes with the call's row count, at sizes that
  depend on the machine and the weight's shape (``probe``). ``InvariantLinear`` runs the exact rows' share
  of every linear in calls whose sizes the probe measured to agree bit for bit (vLLM's batch-invariant
  mode fixes its matmul tiles for the same reason).
- Attention reduces over a row's columns in an order fixed by where they sit. Plain decoding's query sees a
  contiguous prefix (trailing masked columns change nothing, measured up to 2,048); a tree node's ancestors
  sit among masked siblings, so its sums group differently. ``PathLayout`` gives each exact row's node its
  own copy of the columns it sees, in plain decoding's order: the committed columns, then its root-to-node
  path, then masked columns.
- A query's attention also depends on the other queries of its call (the CPU's fused kernel: 1 to 21 of
  8-200 queries of a causal block differ from the same query alone, contexts 64-600). Plain decoding asks
  one query per row, so every exact query attends as a call's only query: a tree node over its path, and
  each position of a prefill chunk (a preempted row's recompute, a chunk split elsewhere, a prefix-cache
  hit's suffix) over the row's columns, batched with its keys expanded, not copied.

With both, seeded ``ddtree`` / ``dflash`` emit seeded ``ar``'s tokens in bf16, alone and in any batch. The
price is paid only in forwards with an exact row: a second, chunked pass of the exact rows' linears and a
gather of ``nodes`` x ``span`` columns per exact row and layer.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class PathLayout:
    """Each exact row's nodes laid out as plain decoding lays out its query's columns (built once per verify
    forward, shared by the layers)."""

    rows: torch.Tensor  # [E] the exact rows
    index: torch.Tensor  # [E, N, span] the column each node reads at each of its positions
    mask: torch.Tensor  # [E * N, 1, 1, span] True = attend: its committed columns and its path

    @classmethod
    def of(cls, rows: torch.Tensor, starts: torch.Tensor, anc: torch.Tensor, span: int) -> PathLayout:
        """From the verify forward's committed lengths [B] and tree block [B, N, N] (a parent's node index is
        below its children's, so a node's ancestors in column order are its root-to-node path)."""
        a, start = anc[rows], starts[rows]  # [E, N, N], [E]
        e, n, _ = a.shape
        nodes = torch.arange(n, device=a.device)
        path = torch.where(a, nodes, nodes + n).argsort(dim=-1)  # [E, N, N]: its ancestors first, in order
        cols = torch.arange(span, device=a.device)
        rel = cols[None] - start[:, None]  # [E, span] column - start
        at = path.gather(2, rel.clamp(0, n - 1)[:, None].expand(e, n, span))  # [E, N, span]
        index = torch.where(rel[:, None] < 0, cols, (start[:, None, None] + at).clamp(max=span - 1))
        seen = rel[:, None] < a.sum(-1, keepdim=True)  # [E, N, span]: committed, then the path's length
        return cls(rows, index, seen.reshape(e * n, 1, 1, span))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The exact rows' keys or values [B, kv_heads, span, D] as each node reads them:
        [E * N, kv_heads, span, D]."""
        e, n, span = self.index.shape
        x = x[self.rows].transpose(1, 2)  # [E, span, kv_heads, D]
        per_node = x[torch.arange(e, device=x.device)[:, None, None], self.index]  # [E, N, span, kv, D]
        return per_node.reshape(e * n, span, *x.shape[2:]).transpose(1, 2)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """The exact rows' queries [B, heads, N, D] as one query per node: [E * N, heads, 1, D]."""
        q = q[self.rows].transpose(1, 2)  # [E, N, heads, D]
        return q.reshape(-1, q.shape[2], 1, q.shape[3])

    def scatter(self, out: torch.Tensor, per_node: torch.Tensor) -> torch.Tensor:
        """Write the nodes' outputs [E * N, heads, 1, D] over the exact rows of ``out`` [B, heads, N, D]."""
        e, n, _ = self.index.shape
        out[self.rows] = per_node.view(e, n, per_node.shape[1], -1).transpose(1, 2)
        return out


@dataclass
class ExactRows:
    """A forward's exact rows: the linear mode over them and, for a tree verify forward, their layout."""

    rows: torch.Tensor  # [E]
    indices: tuple[int, ...]  # the same rows, on the host
    batch: int
    layout: PathLayout | None = None

    def linear(self) -> InvariantLinear:
        return InvariantLinear(self.rows, self.batch)

    def attend(
        self,
        out: torch.Tensor,  # [B, heads, T, Dv]: the batch's attention, the exact rows' part overwritten
        q: torch.Tensor,  # [B, heads, T, D]
        keys: torch.Tensor,  # [B, kv_heads, span, D]
        values: torch.Tensor,  # [B, kv_heads, span, Dv]
        mask: torch.Tensor,  # [B, 1, T, span]
        scale: float,
    ) -> torch.Tensor:
        """The exact rows' attention again, as plain decoding computes it: one query per call, a tree's node
        over its own path, a prefill's position over the row's columns."""
        if self.layout is not None:
            paths = self.layout
            per_node = attend(paths.queries(q), paths.gather(keys), paths.gather(values), paths.mask, scale)
            return paths.scatter(out, per_node)  # per_node: [E * N, heads, 1, Dv]
        t = q.shape[2]
        if t == 1:
            return out
        for r in self.indices:
            shape = (t, *keys.shape[1:])
            one = attend(
                q[r].transpose(0, 1)[:, :, None],  # [T, heads, 1, D]
                keys[r : r + 1].expand(shape),  # [T, kv_heads, span, D]: a view
                values[r : r + 1].expand(t, *values.shape[1:]),
                mask[r, 0][:, None, None],  # [T, 1, 1, span]
                scale,
            )  # [T, heads, 1, Dv]
            out[r] = one[:, :, 0].transpose(0, 1)
        return out
