"""Structured outputs' cost (issue 33's benchmark): output tokens/s and tau of ddtree under a JSON schema
against the same requests unconstrained, one request at a time and 16 at once, and the host milliseconds a
round spends on grammar masks (the trees' masks, ``tree_grammar_masks``, and the next-token masks of the
first token and the first tree level, ``grammar.mask_next``).

Configurations alternate (unconstrained, schema, schema, unconstrained) so drift on a shared machine
lands on both. ``python scripts/structured_bench.py --threads 2``
"""

from __future__ import annotations

import argparse
import time

import torch

import ddtree.engine.verifier as verifier_module
import ddtree.grammar as grammar_module
from ddtree import Engine, SamplingParams, StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "age": {"type": "integer"},
    },
    "required": ["name", "tags", "age"],
}
PROMPTS = [f"Describe person number {i} as JSON with a name, tags and an age:\n" for i in range(16)]


class GrammarClock:
    """Host seconds spent in the grammar mask functions the engine calls (wrapped in place)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for module, name in ((verifier_module, "tree_grammar_masks"), (grammar_module, "mask_next")):
            setattr(module, name, self._timed(getattr(module, name)))

    def _timed(self, fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        return run


def run(engine: Engine, clock: GrammarClock, clients: int, constrained: bool, tokens: int) -> dict:
    spec = StructuredOutputs(json=SCHEMA) if constrained else None
    params = SamplingParams(max_new_tokens=tokens, structured_outputs=spec)
    clock.seconds = 0.0
    out, rounds, elapsed, accepted = 0, 0, 0.0, []
    for start in range(0, len(PROMPTS), clients):
        t = time.perf_counter()
        results = engine.generate(PROMPTS[start : start + clients], [params] * clients)
        elapsed += time.perf_counter() - t
        out += sum(len(r.token_ids) for r in results)
        rounds += max(r.stats.rounds for r in results)
        accepted += [n for r in results for n in r.stats.acceptance_lengths]
    return {
        "tok_s": out / elapsed,
        "tau": sum(accepted) / len(accepted),
        "grammar_ms_per_round": 1e3 * clock.seconds / max(rounds, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(budget=args.budget, max_num_seqs=16, prefill_gap_rounds=None)
    clock = GrammarClock()
    run(engine, clock, 16, True, 8)  # warm-up: compile the schema, touch every shape once
    print("| clients | constraint | output tok/s (runs) | tau | grammar host ms / round |")
    print("|---|---|---|---|---|")
    for clients in (1, 16):
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for constrained in (False, True, True, False):
            engine.reset_prefix_cache()
            runs[constrained].append(run(engine, clock, clients, constrained, args.max_new_tokens))
        for constrained, got in runs.items():
            speeds = ", ".join(f"{g['tok_s']:.1f}" for g in got)
            tau = sum(g["tau"] for g in got) / len(got)
            ms = sum(g["grammar_ms_per_round"] for g in got) / len(got)
            name = "JSON schema" if constrained else "none"
            print(f"| {clients} | {name} | {speeds} | {tau:.2f} | {ms:.2f} |")


if __name__ == "__main__":
    main()
