"""The engine's request API: a continuously batched loop of rounds, draft -> tree -> verify -> accept.

Every running request is a row with its own KV blocks, method, budget, sampling parameters, random
generator and KV length, so a request's output is the same alone or in any batch. Three methods share
the round and differ only in the tree they verify: ``ddtree`` the best-first tree of the ``budget`` most
probable draft prefixes, ``dflash`` the drafter's argmax chain, ``ar`` the root alone (no drafter pass).

Who owns what (``docs/design.md``): ``Scheduler`` who runs, chunked prefill and preemption, with the
``BlockManager``'s KV blocks; ``ModelRunner`` the weights, paged caches, fixed shapes and forwards;
``Proposer`` the drafter pass and each row's tree; ``Verifier`` the verify batch, acceptance and commit;
``AutoBudget`` the ``budget="auto"`` choice; ``EngineCore`` a step top to bottom; ``Streams`` where its
deltas go. This facade builds them and holds the request API (vLLM's ``LLMEngine``: ``add_request`` /
``step`` / ``abort``; ``generate`` and ``stream`` drive that loop for callers that want results).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ddtree.config import EngineConfig
from ddtree.engine.auto_budget import AutoBudget
from ddtree.engine.block_manager import BlockManager
from ddtree.engine.core import EngineCore
from ddtree.engine.launch import load_models
from ddtree.engine.memory import CacheConfig
from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.proposer import Proposer
from ddtree.engine.request import GenerationResult, GenerationStats, Request, StreamDelta
from ddtree.engine.scheduler import Scheduler, delta_of
from ddtree.engine.step_channel import StepChannel, close_channel
from ddtree.engine.streams import Streams
from ddtree.engine.verifier import Verifier
from ddtree.errors import DDTreeError
from ddtree.model.loader import (
    DEFAULT_DRAFTER,
    DEFAULT_TARGET,
    check_device,
    check_pair,
    check_target_attention,
    eos_token_ids,
    media_token_ids,
)
from ddtree.request.output import OutputState
from ddtree.request.params import AUTO, SamplingParams, StructuredOutputs, check_speculative_options
from ddtree.request.penalties import RequestPenalties
from ddtree.speculative.budget import CostModel
from ddtree.speculative.coins import key_of
from ddtree.speculative.drafter import DFlashDrafter

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ddtree.request.grammar import GrammarCompiler


def check_engine_options(
    method: str, budget: int, topk: int | None, has_drafter: bool
) -> tuple[str, int, int | None]:
    method, budget, topk = check_speculative_options(method, budget, topk)
    if method != "ar" and not has_drafter:
        raise DDTreeError(f"method {method!r} needs a drafter; pass one or use method 'ar'")
    return method, budget, topk


class Engine:
    """Lossless speculative decoding of ``target`` with a DFlash ``drafter``, for a batch of requests."""

    def __init__(
        self,
        target,
        drafter: DFlashDrafter | None = None,
        tokenizer=None,
        config: EngineConfig | None = None,
        *,
        cost_model: CostModel | None = None,
        channel: StepChannel | None = None,
        **options,
    ) -> None:
        """``config`` (``ddtree.config.EngineConfig``: every option, its default and its check) with
        ``options`` (its fields as keywords) over it. ``cost_model``: budget "auto"'s starting costs
        (measured at the first auto round when None).
        ``channel``: rank 0's step channel when ``target`` is its tensor-parallel shard (built by
        ``from_pretrained(tensor_parallel_size=N)``, which starts the other ranks)."""
        config = EngineConfig.build(config, **options)
        if config.tensor_parallel_size != 1 and channel is None:
            raise DDTreeError(
                "tensor_parallel_size needs Engine.from_pretrained(TARGET_DIR, DRAFTER_DIR, "
                "tensor_parallel_size=N): every rank loads its own shard from the target's directory"
            )
        self.config = config
        self.target = target.eval()
        self.tokenizer = tokenizer
        if drafter is not None:
            check_pair(target, drafter, tokenizer)
        check_engine_options(config.method, config.budget, config.topk, drafter is not None)
        context = int(getattr(target.config, "max_position_embeddings", 1 << 30))
        if config.max_model_len is not None and config.max_model_len > context:
            raise DDTreeError(
                f"max_model_len {config.max_model_len} exceeds the target's context of {context} tokens"
            )
        check_target_attention(target.config.to_dict(), "target", config.max_model_len or context)
        self.eos_token_ids = eos_token_ids(target, tokenizer)
        self._grammars: GrammarCompiler | None = None  # made at the first structured-output request
        cache_config = CacheConfig(
            config.block_size, config.kv_cache_memory, config.gpu_memory_utilization, config.kv_cache_dtype
        )
        deepest = config.budget if config.budget != AUTO else config.auto_max_budget
        if drafter is not None:
            deepest = max(deepest, drafter.block_size - 1)
        self.runner = ModelRunner(
            target,
            drafter,
            config.max_num_seqs,
            config.max_model_len or context,
            config.max_num_batched_tokens,
            deepest + 1,
            cache_config,
            config.max_model_len is not None,
            config.draft_dtype,
            channel=channel,
        )
        self.max_model_len = self.runner.max_model_len  # lowered to what the KV budget holds, if unset
        self.blocks = BlockManager(
            self.runner.num_blocks, config.block_size, prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.blocks, config.max_num_seqs, config.max_num_batched_tokens, self.runner.draft_block
        )
        self.proposer = Proposer(self.runner, config.auto_max_budget)
        self.verifier = Verifier(self.runner, config.accept_threshold_single, config.accept_threshold_acc)
        self.auto = AutoBudget(self.runner, self.scheduler, cost_model, self.proposer.timed_pass)
        self.runner.setup_shapes(config, deepest)
        if config.method == "ddtree":
            self.runner.shapes.check_captured_budget(config.budget)
        self.core = EngineCore(
            self.runner,
            self.scheduler,
            self.proposer,
            self.verifier,
            self.auto,
            config.prefill_gap_rounds,
            config.profile,
        )
        self.warmup_seconds = self.core.warm_up() if config.compile else 0.0
        self.streams = Streams(self.core.step, self.abort)

    @property
    def profile(self) -> bool:
        return self.config.profile

    @profile.setter
    def profile(self, on: bool) -> None:
        """Time every stage from the next step on (each stage then waits for the device)."""
        self.config = replace(self.config, profile=on)
        self.core.profile = on

    @classmethod
    def from_pretrained(
        cls,
        target_dir: str | Path | None = None,
        drafter_dir: str | Path | None = None,
        config: EngineConfig | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "auto",
        trust_remote_code: bool = False,
        **options,
    ) -> Engine:
        """Load a target (and drafter) from local directories; with neither, the built-in pair. ``config``
        and ``options`` as for ``Engine``, checked before any weight is read.

        ``dtype`` "auto" is the checkpoint's, except a small (under 100M parameters) bf16 / fp16 model on a
        CPU, which loads as float32, where it is faster (``docs/models.md``).

        ``tensor_parallel_size`` N > 1 shards the target over N ranks (``ddtree.engine.launch``): this
        process is rank 0 and spawns ranks 1..N-1 (gloo on the CPU; NCCL on GPUs 0..N-1), or, started by
        torchrun, joins its ranks; there a rank other than 0 serves rank 0's steps and exits when it stops.
        ``close()`` (or ``with``) ends them.

        ``trust_remote_code`` lets a tokenizer that ships as code in the checkpoint (Kimi's) run; the model
        is always transformers' own class."""
        if target_dir is None and drafter_dir is None:
            target_dir, drafter_dir = DEFAULT_TARGET, DEFAULT_DRAFTER
        config = EngineConfig.build(config, **options)
        check_engine_options(config.method, config.budget, config.topk, drafter_dir is not None)
        target, drafter, tokenizer, channel = load_models(
            target_dir, drafter_dir, config, check_device(device), dtype, trust_remote_code
        )
        try:
            engine = cls(target, drafter, tokenizer, config, channel=channel)
        except BaseException:
            if channel is not None:
                close_channel(channel)
            raise
        if channel is not None and channel.ranks is not None:
            channel.ranks.watch()
        return engine

    # -- tensor parallelism ------------------------------------------------------------------------------

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.tensor_parallel_size

    def watch_ranks(self, callback) -> None:
        """Call ``callback(reason)`` (from a watcher thread) if a tensor-parallel rank dies."""
        channel = self.runner.channel
        if channel is not None and channel.ranks is not None:
            channel.ranks.callbacks.append(callback)
            if channel.ranks.failure is not None:
                callback(channel.ranks.failure)

    def close(self) -> None:
        """End the other tensor-parallel ranks (nothing to do in one process); the engine runs no more."""
        self.runner.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def kv_cache_summary(self) -> dict:
        """The KV pool in the numbers a deployment sizes by (the server's start-up log, ``--stats``):
        tokens it holds, the target's bytes per token (all layers; MLA's latent or GQA's keys and values)
        and the dtype they are held in (float32 for a half-precision model on a CPU where that costs no
        context: ``memory.plan_pool``), how many requests at ``max_model_len`` fit at once (the drafter's
        pool shares the blocks), and whether full blocks are shared between requests (prefix caching)."""
        runner = self.runner
        return {
            "kv_cache_tokens": (self.blocks.num_blocks - 1) * self.blocks.block_size,
            "kv_cache_bytes_per_token": self.runner.kv_cache_bytes_per_token,
            "kv_cache_dtype": str(runner.cache.dtype).removeprefix("torch."),
            "kv_cache_layout": "MLA latent" if runner.cache.layout.is_latent else "GQA keys and values",
            "max_concurrency": (self.blocks.num_blocks - 1) / runner.width,
            "prefix_caching": self.blocks.prefix_caching,
        }

    # -- request-level API -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def running(self) -> list[Request]:
        """The running requests, in admission order (their state is public; the engine owns it)."""
        return list(self.scheduler.running)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        method: str | None = None,
        budget: int | None = None,
        topk: int | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; it starts (prefill) at a coming ``step``. Bad input raises ``DDTreeError`` here,
        before anything runs, and leaves the other requests alone. Requests with different ``cache_salt``s
        never share prefix-cache blocks."""
        params = params or SamplingParams()
        method, budget, topk = check_engine_options(
            method or self.config.method,
            self.config.budget if budget is None else budget,
            self.config.topk if topk is None else topk,
            self.runner.drafter is not None,
        )
        if method == "ddtree":
            self.runner.shapes.check_captured_budget(budget)
        prompt_ids = self.encode(prompt)
        if len(prompt_ids) + params.max_new_tokens > self.max_model_len:
            raise DDTreeError(
                f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context of {self.max_model_len} tokens (max_model_len)"
            )
        spec = params.structured_outputs  # compiled (and cached) now: a bad one fails here, alone
        grammar = None if spec is None else self._grammar_compiler().state(spec)
        penalties = RequestPenalties.of(
            params, prompt_ids, self.eos_token_ids, self.tokenizer, self.vocab_size
        )
        request_id = self.scheduler.new_id(request_id)
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(1 << 62)
        self.scheduler.add(
            Request(
                request_id=request_id,
                prompt_ids=prompt_ids,
                params=params,
                method=method,
                budget=budget,
                topk=topk,
                output=OutputState(params, self.eos_token_ids, self.tokenizer if params.detokenize else None),
                stats=GenerationStats(
                    method=method,
                    budget=budget if method == "ddtree" else 0,
                    prompt_tokens=len(prompt_ids),
                    accept_thresholds=(self.config.accept_threshold_single, self.config.accept_threshold_acc),
                ),
                generator=torch.Generator(device=self.runner.device).manual_seed(seed),
                key=key_of(seed),
                invariant=self.config.batch_invariant,
                auto_width=self.auto.start_width,
                cache_salt=cache_salt,
                grammar=grammar,
                penalties=penalties,
            )
        )
        return request_id

    @property
    def vocab_size(self) -> int:
        """Tokens the target scores (its LM head's rows; may exceed the tokenizer's)."""
        return self.runner.lm_head.weight.shape[0]

    def check_structured_outputs(self, spec: StructuredOutputs) -> None:
        """Compile ``spec``'s grammar now (cached for ``add_request``): a server calls it off the engine
        thread, so a slow or bad constraint never holds a step. Raises DDTreeError on a bad one."""
        self._grammar_compiler().compile(spec)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise DDTreeError("structured outputs need the target's tokenizer; this target has none")
        if self._grammars is None:
            from ddtree.request.grammar import GrammarCompiler  # xgrammar: only for engines that need it

            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        return self._grammars

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes no running request holds (vLLM's ``reset_prefix_cache``): the next
        requests prefill cold, as when comparing configurations on the same prompts."""
        self.blocks.reset()

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request (its row is free for the next step); False if unknown.

        As in vLLM, the request's last delta carries finish_reason "abort" (its stream's, or the next
        ``step``'s)."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return False
        self.streams.route([delta_of(request, len(request.output.token_ids))])
        return True

    def step(self) -> list[StreamDelta]:
        """Admit waiting requests with one batched prefill when a row is free; otherwise run one round for
        every running request.

        Returns one delta per request that changed (requests followed by ``stream`` / ``generate`` get
        theirs there instead); the last delta of a request carries its finish_reason.
        """
        return self.streams.step()

    def generate(
        self,
        prompt: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        method: str | None = None,
        budget: int | None = None,
        topk: int | None = None,
    ) -> GenerationResult | list[GenerationResult]:
        """One prompt -> one result; a list of prompts -> results in input order, decoded as one
        continuously batched run (``params`` may be one for all or one per prompt)."""
        if isinstance(prompt, (list, tuple)) and not prompt:
            raise DDTreeError("generate() got an empty list: give a prompt (text or token ids) or prompts")
        single = isinstance(prompt, str) or not isinstance(prompt[0], (str, list, tuple))
        prompts = [prompt] if single else list(prompt)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise DDTreeError(f"got {len(params)} sampling params for {len(prompts)} prompts")
            all_params = list(params)
        else:
            all_params = [params] * len(prompts)
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, all_params, strict=True):
                ids.append(self.add_request(p, sp, method=method, budget=budget, topk=topk))
        except DDTreeError:
            for request_id in ids:
                self.abort(request_id)
            raise
        results = []
        for stream in [self.streams.follow(request_id) for request_id in ids]:  # every row decodes meanwhile
            result = GenerationResult([], "", "", None, [], ids[len(results)])
            for delta in stream:
                result.token_ids += delta.token_ids
                result.text += delta.text
                result.logprobs += delta.logprobs
                result.finish_reason, result.stats = delta.finish_reason, delta.stats
                result.error = delta.error
                if delta.prompt_logprobs is not None:
                    result.prompt_logprobs = delta.prompt_logprobs
            results.append(result)
        return results[0] if single else results

    def stream(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        method: str | None = None,
        budget: int | None = None,
        topk: int | None = None,
    ) -> Iterator[StreamDelta]:
        """Yield one delta per step until the request finishes (the last one carries finish_reason).

        Bad input raises here, not at the first ``next``. Iterating steps the engine, so every other
        request advances too (a stream's deltas wait in its own queue until it is read); closing the
        iterator early aborts the request.
        """
        return self.streams.follow(self.add_request(prompt, params, method=method, budget=budget, topk=topk))

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; text gets the tokenizer's special tokens (a BOS for Llama) as HF and
        vLLM add them, unless it already has them (a rendered chat template: ``add_special_tokens=False``)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise DDTreeError("a text prompt needs a tokenizer; pass token ids instead")
            # verbose=False: an over-long prompt gets our DDTreeError, not transformers' warning first
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens, verbose=False)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise DDTreeError("prompt is empty")
        vocab = self.runner.embed.num_embeddings
        if any(t < 0 or t >= vocab for t in ids):
            raise DDTreeError(f"prompt token ids must be in [0, {vocab})")
        media = media_token_ids(self.target).intersection(ids)
        if media:
            raise DDTreeError(
                f"prompt holds image/video placeholder token ids {sorted(media)}: ddtree serves this "
                "model's text backbone only; send text"
            )
        return ids
