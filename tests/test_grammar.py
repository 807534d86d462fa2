"""Structured outputs' grammar side (``ddtree.request.grammar``): the masks a draft tree gets are, node by
node,
what a matcher fed that node's path allows; bad constraints are one-line errors (a compile past the bound:
``tests/test_grammar_isolation.py``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xgrammar as xgr

from ddtree.errors import DDTreeError
from ddtree.model.loader import DEFAULT_TARGET, load_tokenizer
from ddtree.request.grammar import GrammarCompiler, apply_masks
from ddtree.request.params import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
CONSTRAINTS = {
    "json": StructuredOutputs.of_schema(SCHEMA),
    "json_object": StructuredOutputs(json_object=True),
    "regex": StructuredOutputs(regex=r"(cat|dog)s? [0-9]{1,3}"),
    "choice": StructuredOutputs(choice=("yes", "no", "maybe so")),
    "grammar": StructuredOutputs(grammar='root ::= "(" root ")" | "x"'),
}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    return GrammarCompiler(tokenizer, vocab_size=4096)


def allowed(mask: torch.Tensor, vocab: int) -> np.ndarray:
    bits = ((mask[:, None] >> torch.arange(32)) & 1).flatten()[:vocab]  # [V]
    return np.flatnonzero(bits.numpy())


def reference(compiler: GrammarCompiler, spec: StructuredOutputs, path: list[int]) -> torch.Tensor | None:
    """What a fresh matcher fed ``path`` allows next, or None when it refuses a token of the path or
    has ended (its stop token accepted: the request would have finished there)."""
    matcher = xgr.GrammarMatcher(compiler.compile(spec))
    if not all(matcher.accept_token(t) for t in path) or matcher.is_terminated():
        return None
    mask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    return mask[0]


def random_tree(compiler, spec, rng, nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """A tree whose nodes mostly take tokens the grammar allows there (so it grows deep), sometimes
    any token (forbidden subtrees)."""
    tokens, parents, paths = [0], [-1], [[]]
    while len(tokens) < nodes:
        parent = int(rng.integers(len(tokens)))
        ok = reference(compiler, spec, paths[parent])
        options = allowed(ok, compiler.vocab_size) if ok is not None else np.arange(compiler.vocab_size)
        token = int(rng.choice(options)) if len(options) and rng.random() < 0.85 else int(rng.integers(4096))
        tokens.append(token)
        parents.append(parent)
        paths.append(paths[parent] + [token])
    order = np.argsort([len(p) for p in paths], kind="stable")  # children after their parents
    relabel = np.empty(nodes, dtype=np.int64)
    relabel[order] = np.arange(nodes)
    parents_out = np.array([-1 if parents[i] < 0 else relabel[parents[i]] for i in order])
    return np.array(tokens)[order], parents_out


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_every_tree_node_gets_what_a_matcher_fed_its_path_allows(compiler, kind):
    spec = CONSTRAINTS[kind]
    rng = np.random.default_rng(0)
    state = compiler.state(spec)
    for _ in range(3):
        tokens, parents = random_tree(compiler, spec, rng, nodes=24)
        before = state.next_mask().clone()
        masks = state.tree_masks(tokens, parents)  # [N, W]
        assert torch.equal(state.next_mask(), before)  # the walk leaves the request's state as it was
        for node in range(len(tokens)):
            path, at = [], node
            while at > 0:
                path.insert(0, int(tokens[at]))
                at = int(parents[at])
            expected = reference(compiler, spec, path)
            if expected is None:  # unreachable: allows everything, so its distribution stays finite
                assert (masks[node] == -1).all(), node
            else:
                assert np.array_equal(masks[node], expected.numpy()), (node, path)


def test_committed_tokens_move_the_state_and_a_forbidden_one_is_an_error(compiler):
    spec = CONSTRAINTS["choice"]
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    state = compiler.state(spec)
    state.accept(tokenizer.encode("maybe"))
    assert (
        allowed(state.next_mask(), 4096).tolist()
        == allowed(reference(compiler, spec, tokenizer.encode("maybe")), 4096).tolist()
    )
    with pytest.raises(DDTreeError, match="against the request's grammar"):
        state.accept(tokenizer.encode("!!"))


def test_masked_logits_keep_allowed_tokens_and_forbid_the_rest(compiler):
    state = compiler.state(CONSTRAINTS["choice"])
    logits = torch.randn(2, 4096)
    original = logits.clone()
    masks = torch.stack([state.next_mask(), torch.full_like(state.next_mask(), -1)])
    apply_masks(logits, masks)
    ok = allowed(masks[0], 4096)
    assert torch.equal(logits[0, ok], original[0, ok]) and torch.isinf(logits[0]).sum() == 4096 - len(ok)
    assert torch.equal(logits[1], original[1])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (lambda: StructuredOutputs(json="{not json"), "invalid structured-output json"),
        (lambda: StructuredOutputs(regex="(unclosed"), "invalid structured-output regex"),
        (lambda: StructuredOutputs(grammar="root ::= undefined_rule"), "invalid structured-output grammar"),
        (lambda: StructuredOutputs(), "exactly one of json, regex, choice, grammar, json_object; got none"),
        (lambda: StructuredOutputs(regex="a", choice=("a",)), "got regex, choice"),
        (lambda: StructuredOutputs(choice=()), "non-empty list of strings"),
        (lambda: StructuredOutputs(regex="a" * 70_000), "at most 65536"),
    ],
)
def test_a_bad_constraint_is_one_line(compiler, spec, message):
    with pytest.raises(DDTreeError, match=message) as info:
        compiler.compile(spec())
    assert "\n" not in str(info.value)


def test_a_schema_given_as_an_object_or_its_text_is_the_same_constraint():
    assert StructuredOutputs.of_schema(SCHEMA) == StructuredOutputs.of_schema(
        json.dumps(SCHEMA, sort_keys=True)
    )
