"""Structured outputs: what a request's text must match (a JSON schema, any JSON object, a regex, one of
a list of strings, an EBNF grammar), compiled once by xgrammar and followed by a matcher per request.

A round needs the constrained distribution at every node of a row's draft tree: the matcher walks the
tree (xgrammar's ``traverse_draft_tree``: accept a node's token, fill the bitmask of what may follow it,
recurse into its children, roll back; SGLang's first-child / next-sibling encoding) and returns one
allowed-token bitmask per node. Masking the target's logits with them at every node makes greedy
acceptance pick the constrained argmax and sampled acceptance draw from the constrained law, so the
output is exactly plain constrained decoding's; a drafted token the grammar forbids is simply never
accepted.

Compiling is isolated per request. A constraint seen for the first time is first compiled in one of
``COMPILE_PROCESSES`` compile processes (forked from a forkserver that has xgrammar loaded: ~7 MB of
their own each, at a lower priority), which is killed if it passes ``COMPILE_SECONDS`` (xgrammar cannot
be interrupted in a thread): that request gets a one-line error, its CPU and memory come back at once, a
replacement starts in the background, and no other request waits on it.
A constraint that compiled there is compiled again here (xgrammar's compiled grammars do not cross
processes cheaply: a serialised one can be hundreds of MB) and kept in xgrammar's cache; each verdict
(compiles in time, or its error) is remembered, so a constraint costs its compile time twice, once. At
most ``COMPILE_PROCESSES`` compiles run at once and ``COMPILES_WAITING`` wait; past that, ``CompilesFull``.
JSON schemas that use what xgrammar would silently ignore (``unenforceable``) or only warn about are
refused, never followed loosely.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import re
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection

import numpy as np
import torch
import xgrammar as xgr

from ddtree.errors import DDTreeError
from ddtree.model.capture import upload
from ddtree.request.params import StructuredOutputs
from ddtree.speculative.tree import ends_with

COMPILE_SECONDS = 10.0
COMPILE_PROCESSES = 4  # first compiles running at once, each in its own process
COMPILES_WAITING = 16  # first compiles waiting for a process; past that, CompilesFull
COMPILE_NICENESS = 10  # added to the compile processes' nice value
VERDICTS = 4096  # constraints whose outcome (compiles in time, or the error) is remembered
CACHE_BYTES = 256 << 20  # compiled grammars kept for reuse (xgrammar evicts the least recently used)

# (name, text, any_whitespace): what is compiled, the same here and in a compile process
Source = tuple[str, str, bool]


class CompilesFull(DDTreeError):
    """Every compile process is busy and the queue for them is full: a retry shortly may succeed."""


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
        self._processes = CompileProcesses(self.info.serialize_json())
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()  # key -> None or the error
        self._deciding: dict[bytes, concurrent.futures.Future] = {}  # one first compile per constraint
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        """The compiled grammar (cached by xgrammar); a constraint that does not compile, or not within
        ``COMPILE_SECONDS``, or that cannot be enforced, is a one-line ``DDTreeError`` naming the problem
        (``CompilesFull`` when too many first compiles are under way)."""
        source = _source(spec)
        error = self._verdict(source)
        if error is not None:
            raise DDTreeError(error)
        return _compile(self._compiler, source)  # proven to finish within the bound

    def _verdict(self, source: Source) -> str | None:
        """None if ``source`` compiles in time, else why not: remembered, or decided once (concurrent
        requests for the same new constraint wait for the one first compile)."""
        key = hashlib.sha256(repr(source).encode()).digest()
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
            deciding = self._deciding.get(key)
            if deciding is None:
                deciding = self._deciding[key] = concurrent.futures.Future()
                owner = True
            else:
                owner = False
        if not owner:
            return deciding.result()
        try:
            verdict = unenforceable(source) or self._processes.check(source)
        except BaseException as exc:  # CompilesFull: not remembered, a retry may find room
            with self._lock:
                del self._deciding[key]
            deciding.set_exception(exc)
            raise
        with self._lock:
            self._verdicts[key] = verdict
            while len(self._verdicts) > VERDICTS:
                self._verdicts.popitem(last=False)
            del self._deciding[key]
        deciding.set_result(verdict)
        return verdict

    def state(self, spec: StructuredOutputs) -> GrammarState:
        return GrammarState(self.compile(spec), self.vocab_size, spec.start_after)


def _source(spec: StructuredOutputs) -> Source:
    any_whitespace = not spec.disable_any_whitespace
    if spec.json is not None:
        return "json", spec.json, any_whitespace
    if spec.json_object:
        return "json_object", "", any_whitespace
    if spec.regex is not None:
        return "regex", spec.regex, any_whitespace
    if spec.choice is not None:
        return "choice", "root ::= " + " | ".join(map(_literal, spec.choice)), any_whitespace
    return "grammar", spec.grammar, any_whitespace


def _compile(compiler: xgr.GrammarCompiler, source: Source) -> xgr.CompiledGrammar:
    name, text, any_whitespace = source
    if name == "json":
        return compiler.compile_json_schema(text, any_whitespace=any_whitespace)
    if name == "json_object":
        return compiler.compile_builtin_json_grammar()
    if name == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)  # choice, grammar


class CompileProcesses:
    """Where constraints are first compiled: ``COMPILE_PROCESSES`` processes forked from a forkserver that
    has imported this module (so xgrammar is loaded: ~15 ms to fork one), each given the tokenizer once
    and compiling one constraint at a time. One that passes ``COMPILE_SECONDS`` is killed and replaced in
    the background: starting one (multiprocessing imports the parent's ``__main__`` in it, as spawn does)
    never counts against a request's bound nor holds one up while another is ready."""

    def __init__(self, tokenizer_info: str) -> None:
        self._info = tokenizer_info
        self._context = multiprocessing.get_context("forkserver")  # fork would copy the engine's threads
        self._context.set_forkserver_preload([__name__])
        self._idle: list[_CompileProcess] = []
        self._running = 0
        self._admitted = 0  # running or waiting
        self._broken: str | None = None  # why a compile process could not start
        self._changed = threading.Condition()  # a process is ready, or a compile ended
        for _ in range(COMPILE_PROCESSES):
            self._replace()

    def _replace(self) -> None:
        threading.Thread(target=self._start, name="ddtree-grammar-start", daemon=True).start()

    def _start(self) -> None:
        try:
            process = _CompileProcess(self._context, self._info)
        except (OSError, EOFError) as exc:
            with self._changed:
                self._broken = f"{type(exc).__name__}: {exc}"
                self._changed.notify_all()
            return
        with self._changed:
            self._idle.append(process)
            self._changed.notify_all()

    def check(self, source: Source) -> str | None:
        """None if ``source`` compiles within ``COMPILE_SECONDS``, else the one-line reason."""
        with self._changed:
            if self._admitted >= COMPILE_PROCESSES + COMPILES_WAITING:
                raise CompilesFull(
                    f"{COMPILE_PROCESSES} structured-output constraints are compiling and "
                    f"{COMPILES_WAITING} waiting; retry shortly"
                )
            self._admitted += 1
            self._changed.wait_for(lambda: self._broken or (self._idle and self._running < COMPILE_PROCESSES))
            if self._broken:
                self._admitted -= 1
                raise DDTreeError(f"structured outputs are unavailable: no compile process ({self._broken})")
            self._running += 1
            process = self._idle.pop()
        alive = False
        try:
            verdict, alive = process.check(source)
        finally:
            with self._changed:
                if alive:
                    self._idle.append(process)
                self._running -= 1
                self._admitted -= 1
                self._changed.notify_all()
            if not alive:
                self._replace()
        return verdict


class _CompileProcess:
    def __init__(self, context, tokenizer_info: str) -> None:
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child,), name="ddtree-grammar", daemon=True)
        self.process.start()
        child.close()
        self.connection.send(tokenizer_info)
        self.connection.recv()  # ready

    def check(self, source: Source) -> tuple[str | None, bool]:
        """(the verdict, whether this process can take another)."""
        try:
            self.connection.send(source)
            if self.connection.poll(COMPILE_SECONDS):
                return self.connection.recv(), True
            verdict = f"the structured-output constraint did not compile within {COMPILE_SECONDS:g} s"
        except (EOFError, OSError):  # it died: xgrammar crashed, or the memory ran out
            verdict = f"the structured-output {source[0]} crashed the grammar compiler"
        self.process.kill()  # its CPU and memory come back now
        self.process.join()
        self.connection.close()
        return verdict, False


def _serve(connection: Connection) -> None:
    """A compile process: given the tokenizer, answers each constraint it is sent with None (it compiled)
    or the error. It runs at a lower priority, so slow compiles take spare cores, not the server's."""
    os.nice(COMPILE_NICENESS)
    info = xgr.TokenizerInfo.deserialize_json(connection.recv())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the answer is all it keeps
    connection.send(None)
    while True:
        try:
            source = connection.recv()
        except EOFError:  # the server is gone
            return
        connection.send(_check(compiler, source))


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[12:00:00] /path/file.cc:123: "


def _check(compiler: xgr.GrammarCompiler, source: Source) -> str | None:
    """Compile ``source`` with xgrammar's log (its stderr) read: a warning that a JSON schema's keyword
    is not followed is an error here, not a line in the server's log."""
    with tempfile.TemporaryFile() as log:
        stderr = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            _compile(compiler, source)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors for bad input
            lines = str(exc).strip().splitlines()
            first = _LOG_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
            return f"invalid structured-output {source[0]}: {first}"
        finally:
            os.dup2(stderr, 2)
            os.close(stderr)
        log.seek(0)
        warnings = [
            line.split("Warning: ", 1)[1]
            for line in log.read().decode(errors="replace").splitlines()
            if "Warning: " in line
        ]
    if warnings:
        return f"the structured-output {source[0]} cannot be enforced as written: {warnings[0]}"
    return None


def unenforceable(source: Source) -> str | None:
    """Why xgrammar could not enforce a JSON schema although it compiles it (it drops these keywords
    without a warning, or warns only in the log; measured with xgrammar 0.2.9), or None."""
    name, text, _ = source
    if name != "json":
        return None
    try:
        schema = json.loads(text)
        problem = next(_ignored(schema, "#"), None)
    except ValueError:  # not JSON: xgrammar's own error says so
        return None
    except RecursionError:
        return "the structured-output json is nested too deeply"
    if problem is None:
        return None
    return f"the structured-output json uses {problem}, which cannot be enforced (refused, not ignored)"


_DROPPED = {  # keywords xgrammar compiles as if absent
    "not": "not",
    "if": "if/then/else",
    "then": "if/then/else",
    "else": "if/then/else",
    "dependentRequired": "dependentRequired",
    "dependentSchemas": "dependentSchemas",
    "dependencies": "dependencies",
    "contains": "contains",
    "minContains": "minContains",
    "maxContains": "maxContains",
}
# Keywords that assert nothing: beside allOf / anyOf / oneOf / $ref they are not lost
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
    | {"$schema", "$id", "$defs", "definitions", "discriminator"}
)
_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (
        (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    ),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}
_SUBSCHEMA = ("additionalProperties", "items", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMAS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions")


def _ignored(schema, at: str) -> Iterator[str]:
    """What in ``schema`` (at JSON pointer ``at``) xgrammar would not enforce, outermost first."""
    if not isinstance(schema, dict):  # true / false: enforced
        return
    for key, feature in _DROPPED.items():
        if key in schema:
            yield f"{feature} (at {at})"
    if schema.get("uniqueItems") is True:
        yield f"uniqueItems (at {at})"
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        yield f"a $ref that does not point into the schema itself ({ref[:80]!r} at {at})"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        yield f"allOf with {len(all_of)} members (at {at})"
    combined = next((k for k in ("$ref", "allOf", "anyOf", "oneOf") if k in schema), None)
    if combined is not None:
        beside = sorted(set(schema) - _ANNOTATIONS - {combined})
        if beside:
            yield f"{combined} beside {', '.join(beside)} (at {at})"
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if types == []:
        yield f"an empty type list (at {at})"
    values = schema.get("enum", []) if isinstance(schema.get("enum"), list) else []
    values = values + [schema["const"]] if "const" in schema else values
    if isinstance(types, list) and types and all(isinstance(t, str) and t in _TYPES for t in types):
        for value in values:
            if not any(_TYPES[t](value) for t in types):
                yield f"an enum or const value of no allowed type ({json.dumps(value)[:40]} at {at})"
    for key in _SUBSCHEMA:
        yield from _ignored(schema.get(key), f"{at}/{key}")
    for key in _SUBSCHEMAS:
        if isinstance(schema.get(key), list):
            for i, member in enumerate(schema[key]):
                yield from _ignored(member, f"{at}/{key}/{i}")
    for key in _NAMED_SUBSCHEMAS:
        if isinstance(schema.get(key), dict):
            for name, member in schema[key].items():
                yield from _ignored(member, f"{at}/{key}/{_escape(name)}")


def _escape(name: str) -> str:
    """A key as a JSON pointer's reference token (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")


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
