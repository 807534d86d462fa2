"""Structured outputs: what a request's text must match (a JSON schema, any JSON object, a regex, one of
a list of strings, an EBNF grammar), compiled once by xgrammar and followed by a matcher per request.

A round needs the constrained distribution at every node of a row's draft tree: the matcher walks the
tree (xgrammar's ``traverse_draft_tree``: accept a node's token, fill the bitmask of what may follow it,
recurse into its children, roll back; SGLang's first-child / next-sibling encoding) and returns one
allowed-token bitmask per node. Masking the target's logits with them at every node makes greedy
acceptance pick the constrained argmax and sampled acceptance draw from the constrained law, so the
output is exactly plain constrained decoding's; a drafted token the grammar forbids is simply never
accepted. Compiled grammars are cached (xgrammar's cache, keyed by the constraint), and compiling is
bounded in time and size: a schema that cannot compile in time is a one-line error, never a stalled
engine.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

import numpy as np
import torch
import xgrammar as xgr

from ddtree.capture import upload
from ddtree.errors import DDTreeError
from ddtree.params import StructuredOutputs
from ddtree.tree import ends_with

COMPILE_SECONDS = 10.0
CACHE_BYTES = 256 << 20  # compiled grammars kept for reuse (xgrammar evicts the least recently used)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and model vocabulary (the LM head's rows, which may
    exceed the tokenizer's: the extra ids are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int] | None = None) -> None:
        stops = list(stop_token_ids) if stop_token_ids else None
        try:
            self.info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=stops
            )
        except ValueError as exc:  # e.g. no stop token: a grammar could never end
            raise DDTreeError(f"structured outputs cannot use this tokenizer: {exc}") from None
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
        self._pool = self._new_pool()

    @staticmethod
    def _new_pool() -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        """The compiled grammar (cached by xgrammar); a constraint that does not compile, or not within
        ``COMPILE_SECONDS``, is a one-line ``DDTreeError`` naming the problem."""
        future = self._pool.submit(self._compile, spec)
        try:
            return future.result(timeout=COMPILE_SECONDS)
        except concurrent.futures.TimeoutError:
            # The stuck compile keeps its thread until it ends; the next constraints get a fresh one, so
            # one pathological constraint never queues the others behind it.
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()
            raise DDTreeError(
                f"the structured-output constraint did not compile within {COMPILE_SECONDS:g} s"
            ) from None
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors for bad input
            kind = next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(spec, k))
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DDTreeError(f"invalid structured-output {kind}: {first}") from None

    def _compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        if spec.json is not None:
            return self._compiler.compile_json_schema(
                spec.json, any_whitespace=not spec.disable_any_whitespace
            )
        if spec.json_object:
            return self._compiler.compile_builtin_json_grammar()
        if spec.regex is not None:
            return self._compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return self._compiler.compile_grammar("root ::= " + " | ".join(map(_literal, spec.choice)))
        return self._compiler.compile_grammar(spec.grammar)

    def state(self, spec: StructuredOutputs) -> GrammarState:
        return GrammarState(self.compile(spec), self.vocab_size, spec.start_after)


def _literal(text: str) -> str:
    """``text`` as an EBNF string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class GrammarState:
    """One request's place in its grammar: advanced by the tokens it commits; asked, each round, what
    may follow every node of its draft tree.

    With ``start_after`` (a reasoning parser's end of thinking) the grammar waits: everything is allowed
    until the output's first run of those ids, and holds from the token after it, as vLLM's structured
    outputs do after the reasoning. In a tree the run may end at any node: the grammar then holds below
    that node."""

    def __init__(
        self, compiled: xgr.CompiledGrammar, vocab_size: int, start_after: Sequence[int] = ()
    ) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)  # rollback is unbounded in xgrammar >= 0.2
        self.vocab_size = vocab_size
        self.mask_width = xgr.get_bitmask_shape(1, vocab_size)[1]  # W = ceil(V / 32) int32 words
        self.waiting_for = tuple(start_after)  # empty once the grammar holds
        self._tail: list[int] = []  # while waiting: the output's last len(waiting_for) - 1 tokens

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing may follow."""
        return not self.waiting_for and self.matcher.is_terminated()

    def accept(self, tokens: Sequence[int]) -> None:
        """Advance past committed tokens (each was allowed by the mask it was chosen under)."""
        tokens = [int(t) for t in tokens]
        while self.waiting_for and tokens:
            self._tail.append(tokens.pop(0))
            if tuple(self._tail[-len(self.waiting_for) :]) == self.waiting_for:
                self.waiting_for, self._tail = (), []
            else:
                self._tail = self._tail[len(self._tail) - len(self.waiting_for) + 1 :]
        for token in tokens:
            if not self.matcher.accept_token(token):
                raise DDTreeError(f"token {token} was committed against the request's grammar")

    def next_mask(self) -> torch.Tensor:
        """[W] int32: the tokens allowed next (bit t of word t // 32), W = ceil(V / 32)."""
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        if not self.waiting_for:
            self.matcher.fill_next_token_bitmask(mask, 0)
        return mask[0]

    def tree_masks(self, tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
        """[N, W] int32: what may follow each node of one tree (node 0 the root, already committed;
        ``parents[0] == -1``, children after their parent, siblings most probable first). A node whose
        own token the grammar forbids is never accepted, nor anything below it; its row allows
        everything, so the distributions computed there stay finite."""
        if not self.waiting_for:
            return self._walk(tokens, parents)
        # Waiting: each node where the run of ``waiting_for`` ends (first on its path) starts the grammar
        # for its subtree, walked with that node as the root; everything else allows every token.
        n = len(tokens)
        masks = np.full((n, self.mask_width), -1, dtype=np.int32)
        owner = np.full(n, -1, dtype=np.int64)  # the node that started the grammar above each node
        for node in range(1, n):
            owner[node] = owner[parents[node]]
            if owner[node] < 0 and ends_with(self.waiting_for, self._tail, tokens, parents, node):
                owner[node] = node
        for start in np.unique(owner[owner >= 0]):
            sub = np.flatnonzero(owner == start)  # the start node first: children come after parents
            local = np.full(n, -1, dtype=np.int64)
            local[sub] = np.arange(len(sub))
            sub_parents = local[parents[sub]]
            sub_parents[0] = -1
            masks[sub] = self._walk(tokens[sub], sub_parents)
        return masks

    def _walk(self, tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
        """xgrammar's walk of a tree from the matcher's state (node 0 accepted already)."""
        n = len(tokens)
        first_child = np.full(n, -1, dtype=np.int64)
        next_sibling = np.full(n, -1, dtype=np.int64)
        last_child = np.full(n, -1, dtype=np.int64)
        for node in range(1, n):
            parent = parents[node]
            if first_child[parent] < 0:
                first_child[parent] = node
            else:
                next_sibling[last_child[parent]] = node
            last_child[parent] = node
        masks = xgr.allocate_token_bitmask(n, self.vocab_size)  # all allowed
        self.matcher.traverse_draft_tree(
            torch.from_numpy(first_child),
            torch.from_numpy(next_sibling),
            torch.from_numpy(np.asarray(tokens, dtype=np.int64)),
            masks,
        )
        masks[(masks == 0).all(dim=1)] = -1  # unreachable: xgrammar leaves a forbidden node's row empty
        return masks.numpy()


def mask_next(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> torch.Tensor:
    """``logits`` [B, V] (a copy) with what each row's grammar forbids next at -inf; rows whose state is
    None are left alone. One pinned upload for the row indices and one for the masks."""
    constrained = [i for i, state in enumerate(states) if state is not None]
    if not constrained:
        return logits
    at = upload(np.asarray(constrained, dtype=np.int64), logits.device)
    masks = torch.stack([states[i].next_mask() for i in constrained]).numpy()  # [C, W] int32
    logits = logits.clone()
    logits[at] = apply_masks(logits[at], upload(masks, logits.device))
    return logits


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``logits`` [..., V] with the tokens ``masks`` [..., W] forbids set to -inf, in place (xgrammar's
    kernel: CUDA or CPU)."""
    flat = logits.view(-1, logits.shape[-1])
    xgr.apply_token_bitmask_inplace(flat, masks.reshape(-1, masks.shape[-1]))  # on logits' device
    return logits
