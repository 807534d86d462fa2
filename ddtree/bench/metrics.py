"""Metric definitions of the benchmark, on plain per-response records (the dicts ``runner`` writes).

Every number in the report comes from a function here, so each definition lives in one place, is tested
on hand-built records (``tests/test_bench_metrics.py``) and is spelled out in ``DEFINITIONS``, which goes
into ``results.json`` and ``results.md`` next to the numbers.

A record is one response of one configuration (``label``: ``ar``, ``dflash``, ``ddtree@B``, ``hf``,
``hf-pld``; with ``--compile`` also ``ar+compiled``, ... for the engine built with ``compile=True``,
``compiled`` true) to one prompt at one temperature in one repeat. The fields used here:

  ``acceptance_lengths``  tokens committed by each decode round (accepted drafts + 1); prefill excluded
  ``decode_seconds``      wall time of all decode rounds (the engine's ``GenerationStats.decode_seconds``)
  ``first_draft_seconds`` the drafter's first pass, part of round 1 but counted as prefill (see TPOT)
  ``decode_tokens``       tokens emitted by the decode rounds = output tokens - the one prefill emitted
  ``stage_seconds``       {draft, tree, inputs, verify, accept, commit} summed over the rounds (None for HF)
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict

from ddtree.bench.runner import COMPILED_SUFFIX
from ddtree.request.stats import mean_acceptance_length

FORWARD_STAGES = ("draft", "verify")  # the stages that hold the drafter and target forwards
REFERENCE = "ar"  # the label every speedup divides by, and the T = 0 reference output

DEFINITIONS = {
    "tau": "mean over responses of the response's mean acceptance length, where a round's acceptance "
    "length is the number of tokens it commits = accepted draft tokens + 1 (the bonus token); the prefill "
    "token is not a round. Responses with no decode round (one output token) are left out.",
    "tpot": "time per output token of one response = (decode_seconds - first_draft_seconds) / "
    "decode_tokens. decode_seconds is the wall time of the decode rounds (prefill excluded); "
    "first_draft_seconds is the drafter's first pass, which reads the features of the whole prompt "
    "and so is the drafter's prefill (0 for ar and the HF baselines); decode_tokens = output tokens - 1, "
    "the first token coming from the prefill. The configuration's TPOT is the mean over responses "
    "(those with decode_tokens > 0). HF baselines: see hf_timing.",
    "speedup": "mean TPOT of 'ar' / mean TPOT of the configuration, both over the same prompts, "
    "temperature and repeat of this run; the reported value is the median over repeats of these "
    "per-repeat ratios (speedup_per_repeat lists them; speedup_pooled divides the means over all repeats). "
    "Compiled configurations divide the same eager 'ar' TPOT.",
    "compiled": "true for a configuration run on the engine built with compile=True (label suffix "
    "'+compiled'): every round padded to a fixed batch and node bucket and the target and drafter forwards "
    "torch.compile'd (CUDA graphs on CUDA), all shapes compiled at start-up (compile.warmup_seconds, not "
    "part of any timing); false for the default (eager) engine.",
    "compile_speedup": "compiled configurations: mean TPOT of the same configuration on the eager engine / "
    "mean TPOT on the compiled one, over all repeats (> 1: compiling paid).",
    "stage_seconds_per_round": "seconds of each engine stage (draft, tree build, inputs = the verify "
    "batch's tensors, verify, accept, commit) summed over all rounds of all responses, divided by the "
    "number of rounds. 'other' is decode time outside the stage timers (loop bookkeeping).",
    "stage_fractions": "each stage's seconds (and 'other') / total decode_seconds, over all responses.",
    "overhead_fraction": "share of decode time outside the drafter and target forwards = "
    "1 - (draft + verify) / decode_seconds: tree + inputs + accept + commit + other. When the engine "
    "times no separate 'accept' stage (verify_includes_acceptance true), 'verify' also covers the "
    "acceptance step and this is a lower bound on the true overhead.",
    "host_seconds_per_round": "a round's wall time minus its two forwards (draft and verify stages), per "
    "round: tree build, verify inputs, acceptance (with the LM head) and commit, i.e. the work the host "
    "prepares or waits for around the forwards.",
    "acceptance_histogram": "number of rounds that committed k tokens, over all rounds of all responses "
    "of the configuration (pooled); fractions divide by the number of rounds.",
    "peak_memory": "CUDA: max over responses of torch.cuda.max_memory_allocated() (reset before each "
    "response). CPU: the process's peak RSS (getrusage ru_maxrss), a high-water mark of the whole run, not "
    "of one configuration.",
    "hf_timing": "HF generate() is timed with a streamer that timestamps every put(): the first put "
    "after the prompt carries the token(s) of the first target forward over the prompt (1 token for plain "
    "generate, up to prompt_lookup_num_tokens + 1 for prompt lookup, whose first forward also verifies "
    "candidates); prefill = call -> that put, decode = that put -> streamer.end(), decode_tokens = tokens "
    "after that put, acceptance lengths = tokens per later put (one per target forward).",
    "tree_build": "median wall time of the round's tree stage alone (draft_candidates: log-softmax and "
    "top-k per position; then the batched device beam build_tree_batch) on synthetic logits scale * "
    "N(0, 1) of shape [rows, positions, vocab], per rows and budget; not part of the decode timings.",
    "t0_check": "at temperature 0 every configuration's tokens (cut after the first EOS) must equal "
    "'ar''s for the same prompt and repeat; any difference is a correctness bug of the method (or "
    "numerical non-determinism) and fails the run (exit code 3).",
}


def response_tau(record: dict) -> float | None:
    """Mean acceptance length of one response; None when it had no decode round."""
    lengths = record["acceptance_lengths"]
    return mean_acceptance_length(lengths) if lengths else None


def tau(records: list[dict]) -> float | None:
    """Mean over responses of the per-response mean acceptance length (the paper's tau)."""
    values = [t for r in records if (t := response_tau(r)) is not None]
    return sum(values) / len(values) if values else None


def tpot(record: dict) -> float | None:
    """Decode seconds per decode token of one response, the drafter's first (prefill-like) pass excluded."""
    if record["decode_tokens"] <= 0:
        return None
    return (record["decode_seconds"] - record.get("first_draft_seconds", 0.0)) / record["decode_tokens"]


def mean_tpot(records: list[dict]) -> float | None:
    values = [t for r in records if (t := tpot(r)) is not None]
    return sum(values) / len(values) if values else None


def speedups(records: list[dict], label: str, reference: str = REFERENCE) -> list[float]:
    """Per-repeat ratios mean TPOT(reference) / mean TPOT(label), over the records of one temperature."""
    by_repeat: dict[int, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_repeat[r["repeat"]][r["label"]].append(r)
    ratios = []
    for repeat in sorted(by_repeat):
        ref, mine = mean_tpot(by_repeat[repeat][reference]), mean_tpot(by_repeat[repeat][label])
        if ref is not None and mine:
            ratios.append(ref / mine)
    return ratios


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def acceptance_histogram(records: list[dict]) -> dict[int, int]:
    """Rounds per acceptance length, pooled over all responses; keys sorted ascending."""
    counts = Counter(k for r in records for k in r["acceptance_lengths"])
    return dict(sorted(counts.items()))


def histogram_fractions(histogram: dict[int, int]) -> dict[int, float]:
    total = sum(histogram.values())
    return {k: v / total for k, v in histogram.items()} if total else {}


def stage_breakdown(records: list[dict]) -> dict | None:
    """Per-round stage seconds, their shares of decode time, and the overhead fraction; None for HF.

    The stages are whatever the engine timed (``ddtree.engine.STAGES``), so a finer timer added to the engine
    (say ``accept`` split out of ``verify``) shows up here without a change.
    """
    timed = [r for r in records if r.get("stage_seconds") is not None]
    rounds = sum(len(r["acceptance_lengths"]) for r in timed)
    decode = sum(r["decode_seconds"] for r in timed)
    if not timed or rounds == 0 or decode <= 0:
        return None
    names = list(dict.fromkeys(s for r in timed for s in r["stage_seconds"]))
    totals = {s: sum(r["stage_seconds"].get(s, 0.0) for r in timed) for s in names}
    totals["other"] = decode - sum(totals.values())
    forwards = sum(totals.get(s, 0.0) for s in FORWARD_STAGES)
    return {
        "rounds": rounds,
        "stage_seconds_per_round": {s: v / rounds for s, v in totals.items()},
        "stage_fractions": {s: v / decode for s, v in totals.items()},
        "overhead_fraction": 1.0 - forwards / decode,
        "host_seconds_per_round": (decode - forwards) / rounds,  # the round's wall time minus its forwards
        "verify_includes_acceptance": "accept" not in totals,
    }


def summarize(records: list[dict], reference: str = REFERENCE) -> list[dict]:
    """One row per (temperature, label), in the order the labels first appear in ``records``."""
    groups: dict[tuple[float, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["temperature"], r["label"])].append(r)
    rows = []
    for (temperature, label), group in sorted(groups.items(), key=lambda kv: kv[0][0]):
        same_t = [r for r in records if r["temperature"] == temperature]
        per_repeat = speedups(same_t, label, reference)
        ref_tpot = mean_tpot([r for r in same_t if r["label"] == reference])
        my_tpot = mean_tpot(group)
        compiled = bool(group[0].get("compiled", False))
        eager_tpot = None
        if compiled:
            eager_tpot = mean_tpot([r for r in same_t if r["label"] == label.removesuffix(COMPILED_SUFFIX)])
        histogram = acceptance_histogram(group)
        memory = [r["peak_memory_bytes"] for r in group if r.get("peak_memory_bytes") is not None]
        rows.append(
            {
                "temperature": temperature,
                "label": label,
                "method": group[0]["method"],
                "budget": group[0]["budget"],
                "compiled": compiled,
                "responses": len(group),
                "repeats": len({r["repeat"] for r in group}),
                "output_tokens_mean": sum(len(r["token_ids"]) for r in group) / len(group),
                "tau": tau(group),
                "tpot_seconds": my_tpot,
                "tokens_per_second": 1.0 / my_tpot if my_tpot else None,
                "prefill_seconds_mean": sum(r["prefill_seconds"] for r in group) / len(group),
                "speedup": median(per_repeat),
                "speedup_per_repeat": per_repeat,
                "speedup_pooled": ref_tpot / my_tpot if ref_tpot is not None and my_tpot else None,
                "compile_speedup": eager_tpot / my_tpot if eager_tpot is not None and my_tpot else None,
                "acceptance_histogram": histogram,
                "acceptance_fractions": histogram_fractions(histogram),
                "stages": stage_breakdown(group),
                "peak_memory_bytes": max(memory) if memory else None,
                "finish_reasons": dict(Counter(r["finish_reason"] for r in group)),
            }
        )
    order = {label: i for i, label in enumerate(dict.fromkeys(r["label"] for r in records))}
    return sorted(rows, key=lambda row: (row["temperature"], order[row["label"]]))
