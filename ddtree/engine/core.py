"""One engine step, top to bottom: a batched prefill or ONE round for every decoding request.

``EngineCore`` runs what the parts decided: the ``Scheduler`` picks the step's chunks or rows (and their
blocks), the ``ModelRunner`` runs the forwards, the ``Proposer`` drafts and builds the trees, the
``Verifier`` verifies and accepts, ``AutoBudget`` cuts auto rows' trees, and ``Scheduler.update_from_output``
applies the results. A step that fails is traced to the request it came from (``_isolated``). The
``PrefillPacer`` sizes a prefill step while requests decode. The request API over it is ``Engine``'s.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import torch

from ddtree import startup
from ddtree.engine.auto_budget import AutoBudget
from ddtree.engine.clock import StageClock
from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.proposer import Proposer
from ddtree.engine.request import Request, StepOutput, StreamDelta
from ddtree.engine.scheduler import Chunk, Scheduler
from ddtree.engine.step_channel import TensorParallelError
from ddtree.engine.verifier import Verifier, VerifyBatch, exact_rows
from ddtree.request.logprobs import TokenLogprobs, token_logprobs
from ddtree.request.params import SamplingParams
from ddtree.speculative.tree import PaddedTrees, TreeShape, beam_plan, draft_candidates

log = logging.getLogger("ddtree.engine")


SCORE_ROWS = 256  # prompt positions whose logprobs one LM-head call computes


def moving(average: float | None, value: float, weight: float = 0.2) -> float:
    """An exponential moving average's next value (the first value starts it)."""
    return value if average is None else (1 - weight) * average + weight * value


class PrefillPacer:
    """While requests decode, a prefill step's tokens are what ``gap_rounds`` rounds' time prefills (both
    measured, as moving averages), so a long prompt arriving delays the running streams by a few rounds
    per step however fast or slow the machine; at least one KV block a step, and
    ``max_num_batched_tokens`` still caps it. (A step's fixed cost makes small chunks dearer per token: the
    chunk settles where fixed + tokens x cost per token fills the rounds' time.) None: no pacing."""

    def __init__(self, scheduler: Scheduler, gap_rounds: float | None) -> None:
        self.scheduler = scheduler
        self.gap_rounds = gap_rounds
        self.token_seconds: float | None = None  # a prefill step's seconds per token
        self.round_seconds: float | None = None  # a round's seconds

    def prefilled(self, seconds_per_token: float) -> None:
        self.token_seconds = moving(self.token_seconds, seconds_per_token)
        self.pace()

    def rounded(self, seconds: float) -> None:
        self.round_seconds = moving(self.round_seconds, seconds)
        self.pace()

    def pace(self) -> None:
        """Set the scheduler's prefill chunk while requests decode from what was measured."""
        if self.gap_rounds is None or self.round_seconds is None or self.token_seconds is None:
            return
        tokens = int(self.gap_rounds * self.round_seconds / self.token_seconds)
        self.scheduler.decode_chunk = max(self.scheduler.blocks.block_size, tokens)


class EngineCore:
    """The step loop's body over the engine's parts (built by ``Engine``)."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        proposer: Proposer,
        verifier: Verifier,
        auto: AutoBudget,
        prefill_gap_rounds: float | None,
        profile: bool,
    ) -> None:
        self.runner = runner
        self.shapes = runner.shapes
        self.scheduler = scheduler
        self.proposer = proposer
        self.verifier = verifier
        self.auto = auto
        self.pacer = PrefillPacer(scheduler, prefill_gap_rounds)
        self.profile = profile  # time every stage (each stage then waits for the device)

    def step(self) -> list[StreamDelta]:
        """One step: a prefill of waiting or half-prefilled prompts when the scheduler has chunks, else one
        round for every decoding request. Returns a delta per request whose output changed."""
        with torch.inference_mode():
            chunks = self.scheduler.schedule_prefill()
            if chunks:
                deltas = self._isolated(chunks, [c.request for c in chunks], self._prefill)
            elif self.scheduler.decoding:
                rows = self.scheduler.schedule_round(self.proposer.columns)  # blocks taken; may preempt
                drafting = self.scheduler.drafting_this_round(rows)

                def round_of(part: list[Request]) -> list[StreamDelta]:
                    return self._round(part, [r for r in drafting if r in part])

                deltas = self._isolated(rows, rows, round_of)
            else:
                deltas = []
        return deltas

    def _isolated(self, parts: list, requests: list[Request], run: Callable[[list], list[StreamDelta]]):
        """``run(parts)``, a step over ``requests`` (``parts[i]`` is ``requests[i]``'s share: a chunk or the
        row). When it raises, the failure is traced to the requests it came from: each share runs again
        alone (the step changed no request before failing; its sampled rows' generators are rewound first,
        so a seeded row draws the coins it would have drawn) and a request whose share fails alone ends
        with finish_reason "error"; the others' shares make this step. Only a failure every share repeats
        alone (the device, not a request) escapes, as does a tensor-parallel rank's."""
        coins = [(r.generator, r.generator.get_state()) for r in requests if r.params.temperature > 0]
        try:
            return run(parts)
        except TensorParallelError:
            raise
        except Exception as exc:
            first = exc
        deltas: list[StreamDelta] = []
        failed: list[tuple[Request, Exception]] = [(requests[0], first)]
        if len(parts) > 1:
            log.warning("a step of %d requests failed (%s); running each alone", len(parts), first)
            for generator, state in coins:
                generator.set_state(state)
            failed = []
            for part, request in zip(parts, requests, strict=True):
                try:
                    deltas += run([part])
                except TensorParallelError:
                    raise
                except Exception as exc:
                    failed.append((request, exc))
            if len(failed) == len(parts):
                raise first
        for request, exc in failed:
            log.error("request %s failed in a step and ends alone: %s", request.request_id, exc)
            deltas.append(self.scheduler.fail(request, exc))
        return deltas

    def _prefill(self, chunks: list[Chunk]) -> list[StreamDelta]:
        """Prompt chunks in one forward (and, drafting, their features into the drafter's cache). A request
        whose prefill ends gets its first token; a preempted one resumes with its last emitted token."""
        t0 = time.perf_counter()  # the last step ended with a sync: the device is not behind
        batch = [c.request for c in chunks]
        scored = tuple(i for i, r in enumerate(batch) if r.scores_prompt)
        logits, features, hidden = self.runner.prefill(
            [
                (r.prefill_ids[r.computed : r.computed + c.tokens], r.computed)
                for r, c in zip(batch, chunks, strict=True)
            ],
            self.shapes.block_tables(batch),
            features=any(r.drafts for r in batch),
            scored=scored,
            exact=exact_rows(batch),
        )  # [B, V], [B, P, F * H], [L_i, H] per scored row
        drafting = [i for i, r in enumerate(batch) if r.drafts]
        self.proposer.ingest(
            [batch[i] for i in drafting], [features[i, : chunks[i].tokens] for i in drafting]
        )
        first = [i for i, c in enumerate(chunks) if c.last and not c.request.output.token_ids]
        tokens: list[list[int]] = [[] for _ in batch]
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(batch)
        for i, t in zip(
            first, self.verifier.first_tokens(logits[first], [batch[i] for i in first]), strict=True
        ):
            tokens[i] = [t]
            if batch[i].params.logprobs is not None:
                logprobs[i] = token_logprobs(logits[i : i + 1], [t], batch[i].params.logprobs)
        prompt: list[list[TokenLogprobs | None] | None] = [None] * len(batch)
        for i, states in zip(scored, hidden, strict=True):
            prompt[i] = self.prompt_logprobs(batch[i], states)
        seconds = self._now() - t0
        self.pacer.prefilled(seconds / (len(chunks) * max(c.tokens for c in chunks)))
        return self.scheduler.update_from_output(
            StepOutput(
                rows=batch,
                tokens=tokens,
                logprobs=logprobs,
                consumed=[c.tokens if c.request.drafts else 0 for c in chunks],
                features=[None] * len(batch),
                prefilled=[c.tokens for c in chunks],
                seconds=seconds,
                prompt_logprobs=prompt if scored else None,
            )
        )

    def prompt_logprobs(self, r: Request, hidden: torch.Tensor) -> list[TokenLogprobs | None]:
        """The logprobs of the prompt tokens this chunk (hidden [L, H], from column ``r.computed``)
        predicts and ``r`` has not scored yet: token k's comes from position k - 1 (token 0 has none);
        the LM head runs over SCORE_ROWS positions at a time (a 152k vocabulary: 0.6 GB a 1,000)."""
        start, done = r.computed, len(r.prompt_logprobs or [])
        last = min(start + hidden.shape[0], len(r.prompt_ids) - 1)  # the last prompt token predicted here
        out: list[TokenLogprobs | None] = [None] if start == 0 and done == 0 else []
        first = max(start + 1, done, 1)  # the first new token
        for k in range(first, last + 1, SCORE_ROWS):
            end = min(k + SCORE_ROWS, last + 1)
            logits = self.runner.lm_head(hidden[k - 1 - start : end - 1 - start])  # [m, V]
            out += token_logprobs(logits, r.prompt_ids[k:end], r.params.prompt_logprobs)
        return out

    def _round(self, rows: list[Request], drafting: list[Request]) -> list[StreamDelta]:
        """Draft, build every row's tree, verify all trees in one target forward, accept, commit.

        From the draft to the verdicts the round runs on the device; the host waits twice: for the trees'
        depth (``Verifier.accept``, while the verify forward runs) and for the verdicts
        (``Verifier.verdicts``). Rows with budget "auto" add one copy (their trees' draft log-probs) and
        time the stages, as profiling does (``StageClock``: CUDA events read after the round's last sync,
        so timing adds no wait). The scheduler then applies the round to its rows.
        """
        clock = StageClock(self.runner.device, self.profile or any(r.auto for r in rows))
        t_round = time.perf_counter()  # the last step ended with a sync: the device is not behind
        with clock.stage("draft"):
            drafted, consumed = (
                self.proposer.draft(drafting) if drafting else (None, [])
            )  # [D, block_size - 1, H]
        with clock.stage("tree"):
            trees = self.proposer.trees(rows, drafting, drafted)  # the draft head, then the trees
            seen = None
            if any(r.auto for r in drafting):
                trees, seen = self.auto.choose(rows, trees, len(drafting))
        with clock.stage("inputs"):
            batch = self.verifier.inputs(rows, trees)
        with clock.stage("verify"):
            # Features whenever a row drafts, and always with fixed shapes (one graph per shape).
            want = self.shapes.fixed or any(r.drafts for r in rows)
            padded, features = self.runner.verify(*batch.forward_args(want))  # [Bp, Np, H]
            hidden = padded[: batch.rows, : batch.nodes]  # [B, N, H] (padded with fixed shapes)
            features = None if features is None else features[: batch.rows, : batch.nodes]  # [B, N, F * H]
        with clock.stage("accept"):
            accepted = self.verifier.accept(rows, trees, hidden, padded)  # the LM head closes the forward
        with clock.stage("commit"):
            verdicts = self.verifier.verdicts(rows, accepted, hidden, features, batch)
            status = self.auto.learn(rows, trees.sizes, seen, verdicts)
            eaten = {id(r): k for r, k in zip(drafting, consumed, strict=True)}
            deltas = self.scheduler.update_from_output(
                StepOutput(
                    rows=rows,
                    tokens=verdicts.tokens,
                    logprobs=verdicts.logprobs,
                    consumed=[eaten.get(id(r), 0) for r in rows],
                    features=verdicts.features,
                    drafted_nodes=[int(m) - 1 for m in trees.sizes],
                    auto_widths={} if seen is None else seen.widths,
                    auto_skip=None if seen is None else seen.skip,
                    auto_rests={} if seen is None else seen.rests,
                    auto_status=status,
                )
            )
        elapsed = time.perf_counter() - t_round
        self.pacer.rounded(elapsed)
        seconds = clock.seconds()
        if clock.enabled:  # the verdicts' LM head grows with the verified tokens as the forward does, and
            # building the trees happens only with a drafter pass: counted as the rest (a level), it was
            # charged to plain rounds too, and at 16 rows drafting looked 3x cheaper than plain than it was
            verified = seconds["verify"] + seconds["accept"]
            drafted = seconds["draft"] + seconds["tree"]
            self.auto.observe(batch.ids.numel(), verified, len(drafting), drafted, elapsed)
        self.scheduler.record_round_time(rows, seconds, elapsed)
        return deltas

    def _now(self) -> float:
        """The host clock once the device has caught up (the prefill's end); a round's stages use
        ``StageClock`` instead, which does not wait."""
        return self.runner.now()

    # -- start-up: every fixed shape once -------------------------------------------------------------

    def warm_up(self) -> float:
        """Run (and so compile and, on CUDA, capture) every fixed shape once with dummy rows, which write
        only the scratch column; returns the seconds it took."""
        runner, shapes, drafter = self.runner, self.shapes, self.runner.drafter
        t = time.perf_counter()
        replays = 3 if runner.device.type == "cuda" else 1  # CUDA graph trees record on the second call
        with torch.inference_mode(), startup.phase("compile"):
            for b, span in itertools.product(shapes.batch_buckets, shapes.span_buckets):
                for n in shapes.node_buckets:
                    batch = self.verifier.inputs([], None, shape=(b, n, span))
                    for _ in range(replays):
                        hidden, _ = runner.verify(*batch.forward_args(True))
                    if span == shapes.span_buckets[0] and shapes.round_compiled and drafter is not None:
                        self._warm_round_graphs(hidden, batch)
                if drafter is not None:
                    bs, tables = drafter.block_size, shapes.block_tables([], b)
                    for _ in range(replays):
                        self.proposer.draft_pass([None] * b, bs, tables, True, span)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        return time.perf_counter() - t

    def _warm_round_graphs(self, hidden: torch.Tensor, batch: VerifyBatch) -> None:
        """Run the round's graphs of one bucket (``hidden`` [Bp, Np, H]: its verify forward's output, from
        ``batch``) on dummy trees with the inputs' dtypes and strides of a real round, so no round
        compiles. The dummy rows' KV pack moves within the scratch block."""
        runner, shapes, device, drafter = self.runner, self.shapes, self.runner.device, self.runner.drafter
        b, n = hidden.shape[:2]
        vocab = runner.lm_head.weight.shape[0]
        sizes = torch.zeros(b, dtype=torch.int64, device=device)
        if n > 1:
            shape = TreeShape.bucket(n, drafter.block_size - 1, vocab)
            logits = torch.zeros(b, shape.depths, vocab, device=device)  # the positions a bucket's trees read
            allowed = torch.zeros(b, shape.depths, dtype=torch.int64, device=device)
            roots = torch.zeros_like(sizes)  # a distinct tensor: a graph is compiled for its inputs' aliasing
            if shapes.lattice:  # the drafter's own lattice of a dummy block: its dtypes and layouts
                width, dtype = runner.draft_head.shape[1], runner.draft_head.dtype
                block = torch.zeros(b, shape.depths, width, dtype=dtype, device=device)  # [B, L, H]
                ids, edges = drafter.lattice(block, logits, roots)
                trees = shapes.tree_graph(edges, ids, roots, allowed, sizes, shape)[:3]
            else:
                vals, ids = draft_candidates(logits, shape.k)
                trees = shapes.tree_graph(vals, ids, roots, allowed, sizes, beam_plan(shape, device))[:3]
        else:  # a tree cut to its root (budget "auto" choosing plain rounds)
            trees = [torch.zeros(b, 1, dtype=torch.int64, device=device) for _ in range(3)]
        padded = PaddedTrees(*trees, sizes)
        shapes.inputs_graph(padded, sizes + 1, runner.cache.scratch, shapes.tree_depth(n))
        verifier, depth = self.verifier, shapes.tree_depth(n)
        verdicts = verifier.decide(shapes.accept_graph, padded, hidden, None, depth, vocab)  # greedy rows
        verifier.pack(verdicts.head(b), batch)
        coins = torch.zeros(b, n, device=device)  # with a sampled row: the law a real round builds
        finals = None if verifier.keyed else coins[:, 0].contiguous()
        law = verifier.law_of([SamplingParams(temperature=1.0)] * b, coins, finals, graph=True)
        verifier.decide(shapes.accept_graph, padded, hidden, law, depth, vocab)
