"""``ddtree bench``: measure tau, TPOT and speedup of ar / dflash / ddtree (and HF baselines).

``register_bench(subparsers)`` adds the subcommand to the main ``ddtree`` parser; ``python -m ddtree.bench``
runs it on its own. Writes ``results.json``, ``results.md``, ``tau_speedup.png`` and
``acceptance_histogram.png`` to ``--out``. With ``--compile`` every engine configuration runs twice, on the
default (eager) engine and on one built with ``compile=True`` from the same weights. Exit code 3 when a
method's greedy output differs from ``ar``'s (the results are written all the same); 2 for a user mistake,
like every ``ddtree`` command.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

from ddtree.argparsing import Parser, add_load_options, apply_threads, comma_list
from ddtree.config import (
    COMPILE_FLAGS,
    MEMORY_FLAGS,
    NUMERICS_FLAGS,
    PARALLEL_FLAGS,
    EngineConfig,
    add_engine_flags,
)
from ddtree.errors import DDTreeError
from ddtree.request.params import parse_budget

DEFAULT_METHODS = "ar,dflash,ddtree,hf,hf-pld"
DEFAULT_BUDGETS = "auto,4,8,16,32,64,128"
DESCRIPTION = """\
Measure tau, TPOT and speedup of ar / dflash / ddtree and HF generate / prompt lookup on the
same prompts, interleaved; writes results.json, results.md and two plots to --out."""
EXAMPLES = """examples:
  ddtree bench --out runs/bench        # the default grid: about 15 minutes on 2 CPU cores
  ddtree bench --methods ar,ddtree --budgets 8,16 --num-prompts 4 --repeats 1 --temperatures 0
  ddtree bench --device cuda --compile --methods ar,dflash,ddtree --budgets 16,64 --num-prompts 4"""


def add_bench_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", type=comma_list(str, "--methods"), default=DEFAULT_METHODS,
                   help="comma-separated, from ar,dflash,ddtree,hf,hf-pld; "
                   "hf = HF generate(), hf-pld = its prompt lookup decoding")  # fmt: skip
    p.add_argument("--budgets", type=comma_list(parse_budget, "--budgets"), default=DEFAULT_BUDGETS,
                   help="ddtree budgets, comma-separated")  # fmt: skip
    p.add_argument("--temperatures", type=comma_list(float, "--temperatures"), default="0,1",
                   help="sampling temperatures, comma-separated; 0 = greedy")  # fmt: skip
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of the sampled runs (T > 0)")
    p.add_argument("--prompts", default="builtin", help="'builtin' or a FILE.jsonl")
    p.add_argument("--num-prompts", type=int, default=16, help="first N prompts; 0 = all")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per response")
    p.add_argument("--repeats", type=int, default=3, help="timed passes over all prompts")
    p.add_argument("--warmup", type=int, default=1, help="untimed prompts run first by every config")
    p.add_argument("--seed", type=int, default=0, help="base seed; each (prompt, repeat) derives its own")
    p.add_argument("--pld-tokens", type=int, default=10, help="hf-pld: prompt_lookup_num_tokens")
    add_load_options(p)
    add_engine_flags(p, ("topk", *PARALLEL_FLAGS, *MEMORY_FLAGS, *COMPILE_FLAGS, *NUMERICS_FLAGS))
    p.add_argument("--tree-vocab", type=int, default=32768,
                   help="vocabulary of the tree-build timing; 0 = skip it")  # fmt: skip
    p.add_argument("--concurrency", type=comma_list(int, "--concurrency"), default=None,
                   help="instead of one request at a time: keep C requests in flight in the batched engine, "
                   "for each C of this list (e.g. 1,4,16); reports throughput vs concurrency")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmark ar / dflash / ddtree (tau, TPOT, speedup)",
        description=DESCRIPTION,
        epilog=EXAMPLES,
    )
    add_bench_options(bench)
    bench.set_defaults(func=run_bench_command)
    from ddtree.bench.serve import register_bench_serve  # here: serve.py imports this module

    register_bench_serve(bench.add_subparsers(dest="bench_command", metavar="serve"))


def compiled_node_buckets(cfg, auto_max_budget: int, drafter) -> list[int]:
    """The default node ladder up to the largest tree the configurations ask for: ddtree's largest integer
    budget (``auto_max_budget`` for "auto"), dflash's chain (``block_size - 1`` drafted nodes)."""
    from ddtree.model.capture import node_ladder
    from ddtree.request.params import AUTO

    deepest = 1
    if "ddtree" in cfg.methods:
        deepest = max(auto_max_budget if b == AUTO else b for b in cfg.budgets)
    if "dflash" in cfg.methods and drafter is not None:
        deepest = max(deepest, drafter.block_size - 1)
    return list(node_ladder(deepest))


def load_engines(args: argparse.Namespace, cfg, config: EngineConfig):
    """{False: the default engine, True: the compiled one (``--compile`` only)} on the same weights, the
    target and drafter directories. ``config``: the flags' (checked). The compiled engine's node buckets
    hold every budget of ``cfg``. Both time their stages (``profile=True``): the runner reads the drafter's
    first pass."""
    from ddtree.engine import Engine
    from ddtree.request.params import AUTO

    if config.tensor_parallel_size > 1:
        return load_sharded_engine(args, cfg, config)
    target, tokenizer, drafter, target_dir, drafter_dir = load_models(args, cfg.needs_drafter)
    method = "ddtree" if drafter is not None else "ar"
    eager = replace(
        config, method=method, compile=False, batch_buckets=None, node_buckets=None, span_buckets=None,
        attention="sdpa",
    )  # fmt: skip
    engines = {False: Engine(target, drafter, tokenizer, eager)}
    if config.compile:
        # Every request names its method and budget; the engine's own are checked against its node
        # buckets: the largest integer budget (a bucket too small for it fails here, before compiling).
        ints = [b for b in cfg.budgets if b != AUTO]
        if "ddtree" in cfg.methods:
            default = {"method": "ddtree", "budget": max(ints) if ints else AUTO}
        else:
            default = {"method": "dflash" if drafter is not None else "ar"}
        node_buckets = config.node_buckets or compiled_node_buckets(cfg, config.auto_max_budget, drafter)
        engines[True] = Engine(
            target, drafter, tokenizer, replace(config, **default, node_buckets=node_buckets)
        )
    return engines, target_dir, drafter_dir


def load_sharded_engine(args: argparse.Namespace, cfg, config: EngineConfig):
    """``--tensor-parallel-size N``: one engine over N ranks (one process group per process, so no compiled
    sibling; and HF's ``generate`` would run rank 0's shard alone, so no ``hf`` methods)."""
    from ddtree.bench.runner import HF_METHODS
    from ddtree.engine import Engine
    from ddtree.engine.launch import check_world
    from ddtree.model.loader import check_device

    check_world(config.tensor_parallel_size, check_device(args.device))
    if config.compile:
        raise DDTreeError(
            "bench --compile compares two engines in one process; not with --tensor-parallel-size"
        )
    if any(m in HF_METHODS for m in cfg.methods):
        raise DDTreeError(
            "--tensor-parallel-size runs the engine's methods only: drop hf and hf-pld from --methods"
        )
    target_dir, drafter_dir = model_dirs(args, cfg.needs_drafter)
    engine = Engine.from_pretrained(
        target_dir,
        drafter_dir,
        replace(config, method="ddtree" if drafter_dir is not None else "ar"),
        device=args.device,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
    )
    return {False: engine}, target_dir, drafter_dir


def compile_info(engines: dict) -> dict:
    """results.json's ``compile``: whether a compiled engine ran, its shapes and its warm-up seconds."""
    engine = engines.get(True)
    if engine is None:
        return {"enabled": False}
    shapes = engine.runner.shapes
    return {
        "enabled": True,
        "warmup_seconds": engine.warmup_seconds,
        "batch_buckets": list(shapes.batch_buckets),
        "node_buckets": list(shapes.node_buckets),
        "span_buckets": list(shapes.span_buckets),
        "attention": shapes.attention,
        "shapes": len(shapes.batch_buckets) * len(shapes.node_buckets) * len(shapes.span_buckets),
        "device": str(engine.runner.device),
    }


def model_dirs(args: argparse.Namespace, needs_drafter: bool):
    """The target's and drafter's directories (the drafter None unless needed) for the flags; the built-in
    pair when no model directory is given."""
    from ddtree.model.loader import DEFAULT_DRAFTER, DEFAULT_TARGET

    if args.target is None and not DEFAULT_TARGET.is_dir():
        raise DDTreeError("the built-in models are not installed; pass --target (and --drafter)")
    target = args.target or DEFAULT_TARGET
    drafter = args.drafter if args.target is not None or args.drafter is not None else DEFAULT_DRAFTER
    if not needs_drafter:
        drafter = None
    elif drafter is None:
        raise DDTreeError("methods dflash and ddtree need --drafter when --target is given")
    return target, drafter


def load_models(args: argparse.Namespace, needs_drafter: bool):
    """Target, tokenizer and drafter (None unless needed) for the flags, and their directories."""
    from ddtree.model.loader import check_device, load_drafter, load_target

    target, drafter = model_dirs(args, needs_drafter)
    device = check_device(args.device)
    target_model, tokenizer = load_target(
        target, device, args.dtype, args.max_model_len, trust_remote_code=args.trust_remote_code
    )
    drafter_model = None
    if drafter is not None:
        dtype = next(target_model.parameters()).dtype  # --dtype auto resolved
        drafter_model = load_drafter(drafter, args.max_model_len).to(device=device, dtype=dtype)
    return target_model, tokenizer, drafter_model, target, drafter


def run_bench_command(args: argparse.Namespace) -> None:
    """Run, write the four outputs, print the Markdown, and fail loudly on a T = 0 mismatch."""
    from ddtree.bench.prompts import load_prompts
    from ddtree.bench.runner import BenchConfig

    cfg = BenchConfig(
        methods=tuple(args.methods),
        budgets=tuple(args.budgets),
        temperatures=tuple(args.temperatures),
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        topk=args.topk,
        seed=args.seed,
        warmup=args.warmup,
        pld_tokens=args.pld_tokens,
        top_p=args.top_p,
        compile=args.compile,
    )
    apply_threads(args.threads)
    if args.tree_vocab < 0:
        raise DDTreeError(f"--tree-vocab must be >= 0, got {args.tree_vocab}")
    prompts = load_prompts(args.prompts, args.num_prompts)
    levels = args.concurrency or (1,)
    if min(levels) < 1:
        raise DDTreeError(f"--concurrency levels must be >= 1, got {min(levels)}")
    config = EngineConfig.from_args(args, max_num_seqs=max(levels), profile=True)
    engines, target_dir, drafter_dir = load_engines(args, cfg, config)
    try:
        bench_engines(args, cfg, prompts, engines, target_dir, drafter_dir)
    finally:
        for engine in engines.values():
            engine.close()  # tensor-parallel ranks end with it


def bench_engines(args: argparse.Namespace, cfg, prompts, engines: dict, target_dir, drafter_dir) -> None:
    """The benchmark proper, on loaded engines."""
    from transformers.utils import logging as hf_logging

    from ddtree.bench.check import MISMATCH_EXIT_CODE, announce, check_greedy_equality
    from ddtree.bench.machine import machine_info
    from ddtree.bench.metrics import DEFINITIONS, summarize
    from ddtree.bench.plots import plot_acceptance_histogram, plot_tau_speedup
    from ddtree.bench.report import markdown, write_outputs
    from ddtree.bench.runner import encode_prompts, run_bench
    from ddtree.bench.tree_speed import measure_tree_build

    engine = engines[False]
    prompt_ids = encode_prompts(engine, prompts, cfg.max_new_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.concurrency is not None:
        run_concurrency_command(args, cfg, engines, prompt_ids)
        return

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # generate()'s per-call notices would bury the progress bar
    started = time.perf_counter()
    try:
        records = run_bench(engines, prompts, prompt_ids, cfg, progress=not args.no_progress)
    finally:
        hf_logging.set_verbosity(verbosity)
    check = check_greedy_equality(records)
    tree_build = measure_tree_build(vocab=args.tree_vocab) if args.tree_vocab else []
    results = {
        "config": {
            "target": str(target_dir),
            "drafter": str(drafter_dir) if drafter_dir is not None else None,
            "prompts": str(args.prompts),
            "num_prompts": len(prompts),
            "methods": list(cfg.methods),
            "budgets": list(cfg.budgets) if "ddtree" in cfg.methods else [],
            "temperatures": list(cfg.temperatures),
            "top_p": cfg.top_p,
            "max_new_tokens": cfg.max_new_tokens,
            "repeats": cfg.repeats,
            "warmup": cfg.warmup,
            "seed": cfg.seed,
            "topk": cfg.topk,
            "pld_tokens": cfg.pld_tokens if "hf-pld" in cfg.methods else None,
            "compile": cfg.compile,
            "order": "for each repeat, prompt, temperature: every config back to back, rotated per repeat",
            "argv": sys.argv,
        },
        "machine": machine_info(engine.runner.device, engine.runner.dtype),
        "wall_seconds": time.perf_counter() - started,
        "compile": compile_info(engines),
        "definitions": DEFINITIONS,
        "prompts": [
            {"index": i, "id": p.id, "prompt_tokens": len(ids)}
            for i, (p, ids) in enumerate(zip(prompts, prompt_ids, strict=True))
        ],  # fmt: skip
        "t0_check": check,
        "t0_mismatch": not check["passed"],
        "summary": summarize(records),
        "tree_build": tree_build,
        "records": records,
    }
    plots = {
        "tau_speedup.png": partial(plot_tau_speedup, results["summary"]),
        "acceptance_histogram.png": partial(plot_acceptance_histogram, results["summary"]),
    }
    write_outputs(args.out, results, markdown(results), plots)
    announce(check)
    if not check["passed"]:
        sys.exit(MISMATCH_EXIT_CODE)


def run_concurrency_command(args: argparse.Namespace, cfg, engines, prompt_ids: list[list[int]]) -> None:
    """``--concurrency``: the throughput sweep; writes results.json, results.md and a plot. ``engines``:
    {False: eager, True: compiled (``--compile`` only)}."""
    from ddtree.bench.check import MISMATCH_EXIT_CODE
    from ddtree.bench.concurrency import goals, greedy_check, markdown, run_concurrency
    from ddtree.bench.machine import machine_info
    from ddtree.bench.plots import plot_throughput
    from ddtree.bench.report import write_outputs

    started = time.perf_counter()
    engine = engines[False]
    records = run_concurrency(
        engines, prompt_ids, cfg, tuple(args.concurrency), progress=not args.no_progress
    )
    check = greedy_check(records, len(prompt_ids))
    results = {
        "config": {
            "prompts": str(args.prompts),
            "num_prompts": len(prompt_ids),
            "methods": [m for m in cfg.methods if m in ("ar", "dflash", "ddtree")],
            "budgets": list(cfg.budgets),
            "temperatures": list(cfg.temperatures),
            "top_p": cfg.top_p,
            "concurrency": list(args.concurrency),
            "max_new_tokens": cfg.max_new_tokens,
            "topk": cfg.topk,
            "seed": cfg.seed,
            "compile": cfg.compile,
            "argv": sys.argv,
        },
        "machine": machine_info(engine.runner.device, engine.runner.dtype),
        "wall_seconds": time.perf_counter() - started,
        "compile": compile_info(engines),
        "t0_check": check,
        "goals": goals(records),
        "records": records,
    }
    plots = {"throughput_concurrency.png": partial(plot_throughput, records)}
    write_outputs(args.out, results, markdown(results), plots)
    if not check["passed"]:
        print(
            f"ddtree: error: {len(check['mismatches'])} greedy responses differ from plain decoding",
            file=sys.stderr,
        )
        sys.exit(MISMATCH_EXIT_CODE)


def main(argv: list[str] | None = None) -> None:
    """``python -m ddtree.bench``: the same command without the main ``ddtree`` parser."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # as the main CLI: stderr is for our progress bar and errors
    parser = Parser(
        prog="ddtree bench",
        description=DESCRIPTION,
        epilog=EXAMPLES,
    )
    add_bench_options(parser)
    try:
        args = parser.parse_args(argv)
        run_bench_command(args)
    except DDTreeError as exc:
        print(f"ddtree: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
