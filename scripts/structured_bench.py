"""What agents' requests cost (issue 33's benchmark): output tokens/s and tau of ddtree under a JSON schema
(or, with ``--options penalties``, under frequency / presence / repetition penalties, a bad word and
min_tokens) against the same requests without, one request at a time and 16 at once, and the host
milliseconds a round spends on them: the grammar's masks (the trees' masks, ``tree_grammar_masks``, and the
next-token masks of the first token and the first tree level, ``grammar.mask_next``) or the penalties
(``NodePenalties``: building a round's state and penalising each node's logits).

Configurations alternate (without, with, with, without) so drift on a shared machine lands on both.
``python scripts/structured_bench.py --threads 2 [--options penalties]``
"""

from __future__ import annotations

import argparse
import time

import torch

import ddtree.engine.verifier as verifier_module
import ddtree.request.grammar as grammar_module
from ddtree import Engine, SamplingParams, StructuredOutputs
from ddtree.request.penalties import NodePenalties

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


PENALTIES = {
    "frequency_penalty": 0.5,
    "presence_penalty": 0.3,
    "repetition_penalty": 1.2,
    "bad_words": ("person",),
    "min_tokens": 16,
}
TIMED = {  # where each option's work happens: (owner, function name)
    "schema": ((verifier_module, "tree_grammar_masks"), (grammar_module, "mask_next")),
    "penalties": ((NodePenalties, "__init__"), (NodePenalties, "__call__")),
}


class Clock:
    """Host seconds spent in the functions that do an option's work (wrapped in place)."""

    def __init__(self, option: str) -> None:
        self.seconds = 0.0
        for owner, name in TIMED[option]:
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        return run


def run(engine: Engine, clock: Clock, clients: int, option: str | None, tokens: int) -> dict:
    if option == "schema":
        params = SamplingParams(max_new_tokens=tokens, structured_outputs=StructuredOutputs(json=SCHEMA))
    elif option == "penalties":
        params = SamplingParams(max_new_tokens=tokens, **PENALTIES | {"min_tokens": min(tokens, 16)})
    else:
        params = SamplingParams(max_new_tokens=tokens)
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
        "ms_per_round": 1e3 * clock.seconds / max(rounds, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--options", choices=tuple(TIMED), default="schema", help="what to compare with none")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(budget=args.budget, max_num_seqs=16, prefill_gap_rounds=None)
    clock = Clock(args.options)
    run(engine, clock, 16, args.options, 8)  # warm-up: compile the schema, touch every shape once
    print(f"| clients | options | output tok/s (runs) | tau | {args.options} host ms / round |")
    print("|---|---|---|---|---|")
    for clients in (1, 16):
        runs: dict[str | None, list[dict]] = {None: [], args.options: []}
        for option in (None, args.options, args.options, None):
            engine.reset_prefix_cache()
            runs[option].append(run(engine, clock, clients, option, args.max_new_tokens))
        for option, got in runs.items():
            speeds = ", ".join(f"{g['tok_s']:.1f}" for g in got)
            tau = sum(g["tau"] for g in got) / len(got)
            ms = sum(g["ms_per_round"] for g in got) / len(got)
            print(f"| {clients} | {option or 'none'} | {speeds} | {tau:.2f} | {ms:.2f} |")


if __name__ == "__main__":
    main()
