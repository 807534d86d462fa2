"""The shapes a round is padded to, and the round's work beside the forwards at those shapes.

Without fixed shapes a round takes the batch's own shapes and its four functions run eagerly. With them
(``EngineConfig.fixed``) rows pad to a batch bucket, trees to a node bucket and attention to a span bucket
(``ddtree.model.capture``), and with ``compile`` each function (tree, verify inputs, acceptance, KV pack)
is compiled to one graph per bucket (the acceptance: one for greedy batches, one for batches with a
sampled row; the tree: the marginal beam's, or a DFlash2 drafter's lattice builder): vLLM's cudagraph
dispatcher beside its runner. The forwards themselves stay the ``ModelRunner``'s.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from ddtree.config import EngineConfig
from ddtree.engine.request import Request
from ddtree.model import capture
from ddtree.model.attention import PagedBlockMask
from ddtree.model.capture import StaticInputs, batch_ladder, check_buckets, compile_forward, node_ladder, pick
from ddtree.model.kv_cache import PagedKVCache, pack_buffers
from ddtree.request.params import check_budget
from ddtree.speculative.tree import beam_tree, lattice_tree
from ddtree.speculative.verify import tree_inputs, tree_verdicts


class RoundShapes:
    """The round's buckets, its persistent inputs (block tables, ``StaticInputs``, flex block masks) and
    graphs (the eager functions until ``setup`` compiles)."""

    def __init__(
        self, device: torch.device, block_size: int, width: int, deepest: int, lattice: bool = False
    ) -> None:
        """``width``: block-table entries a row may own (all of them: the last span bucket); ``deepest``:
        the deepest level a tree may reach (the drafter's block less its root; 0 without a drafter);
        ``lattice``: trees are built over a DFlash2 drafter's lattice (``lattice_tree``), not the beam."""
        self.device = device
        self.block_size = block_size
        self.width = width
        self.capacity = width * block_size  # a row's cache columns
        self.deepest = deepest
        self.fixed = False
        self.compiled = False
        self.round_compiled = False  # the round graphs beside the forwards (capture.COMPILE_ROUND_ON_CPU)
        self.max_drafted = self.capacity  # drafted nodes a tree may hold: a row's (fixed shapes: a bucket)
        self.batch_buckets: tuple[int, ...] = ()
        self.node_buckets: tuple[int, ...] = ()
        self.span_buckets: tuple[int, ...] = ()
        self.inputs = StaticInputs(device, static=False)
        self.attention = "sdpa"
        self.block_masks: dict[tuple[int, int, int], PagedBlockMask] = {}  # (pool, rows, queries) -> mask
        self.lattice = lattice
        self.tree_graph, self.inputs_graph = lattice_tree if lattice else beam_tree, tree_inputs
        self.accept_graph, self.pack_graph = tree_verdicts, pack_buffers

    def setup(self, config: EngineConfig, deepest: int) -> int:
        """Choose the buckets (``deepest``: the most drafted nodes a configured tree asks for) and, with
        ``compile``, compile the round's graphs; returns the forward shapes to compile (0: none).
        ``config``'s buckets are checked already, the span buckets against the row's capacity here.

        With SDPA, attention reads a span bucket of leading cache columns: by default the whole row (one
        graph per batch and node bucket); more buckets make short rows read less (the CPU, long contexts)
        at the price of more graphs. With ``attention="flex"`` each row reads its own blocks up to its
        length (``ddtree.model.attention``), so there is one span: the whole row."""
        self.fixed, self.compiled, self.attention = config.fixed, config.compile, config.attention
        self.inputs = StaticInputs(self.device, static=config.compile and self.device.type == "cuda")
        if not self.fixed:
            return 0
        self.batch_buckets = config.batch_buckets or batch_ladder(config.max_num_seqs)
        self.node_buckets = config.node_buckets or node_ladder(deepest)
        self.max_drafted = self.node_buckets[-1] - 1
        spans = check_buckets("span_buckets", config.span_buckets, self.capacity) or ()
        self.span_buckets = tuple(sorted({*map(self.whole_blocks, spans), self.capacity}))
        if not config.compile:
            return 0
        if self.device.type != "cpu" or capture.COMPILE_ROUND_ON_CPU:
            rounds = len(self.batch_buckets) * len(self.node_buckets)
            graphs = (self.tree_graph, tree_inputs, tree_verdicts, pack_buffers)
            shapes = (rounds, rounds, 2 * rounds, rounds)  # the acceptance: greedy, and with a sampled row
            self.tree_graph, self.inputs_graph, self.accept_graph, self.pack_graph = (
                compile_forward(fn, self.device, n, cuda_graphs=False)
                for fn, n in zip(graphs, shapes, strict=True)
            )
            self.round_compiled = True
        return len(self.batch_buckets) * len(self.node_buckets) * len(self.span_buckets)

    def block_tables(self, requests: list[Request | None], rows: int | None = None) -> np.ndarray:
        """The requests' block tables [rows, width + 1] (None and padding rows: all scratch)."""
        tables = np.zeros((rows or len(requests), self.width + 1), dtype=np.int64)
        for i, r in enumerate(requests):
            if r is not None:
                tables[i, : len(r.blocks)] = r.blocks
        return tables

    def block_mask(
        self,
        cache: PagedKVCache,
        tables: torch.Tensor,
        starts: torch.Tensor,
        tree: torch.Tensor | None,
        queries: int,
    ) -> BlockMask | None:
        """With ``attention="flex"``, this round's block mask over ``cache`` (``PagedBlockMask.update``; one
        set of persistent buffers per shape); None with SDPA, whose dense mask the forward builds."""
        if self.attention != "flex":
            return None
        key = (id(cache), tables.shape[0], queries)
        if key not in self.block_masks:
            self.block_masks[key] = PagedBlockMask(cache, tables.shape[0], queries, self.device)
        return self.block_masks[key].update(tables, starts, tree)

    def span(self, needed: int) -> int:
        """Columns attention reads for ``needed``: whole blocks (with fixed shapes, a span bucket)."""
        return pick(self.span_buckets, needed) if self.fixed else self.whole_blocks(needed)

    def whole_blocks(self, columns: int) -> int:
        """``columns`` rounded up to a multiple of the block size (attention reads whole blocks)."""
        return -(-columns // self.block_size) * self.block_size

    def batch_bucket(self, rows: int) -> int:
        """Rows of a round of ``rows`` requests: that many, or with fixed shapes its bucket."""
        return pick(self.batch_buckets, rows) if self.fixed else rows

    def node_bucket(self, nodes: int) -> int:
        """Tree columns for trees of at most ``nodes`` nodes: that many, or with fixed shapes its bucket."""
        return pick(self.node_buckets, nodes) if self.fixed else nodes

    def tree_depth(self, nodes: int) -> int:
        """A bound on the depth of any tree of ``nodes`` columns, fixed per bucket (the round's graphs
        take one step per level): at most the drafted block, at most ``nodes - 1``."""
        return min(self.deepest, nodes - 1)

    def check_captured_budget(self, budget: int | str) -> None:
        """With fixed shapes a tree fits the largest node bucket (``check_budget``'s rule and message)."""
        if self.fixed:
            why = "the largest node bucket's drafted nodes; start the engine with node_buckets that hold it"
            check_budget(budget, self.max_drafted, why)
