"""The engine loop: prefill, then rounds of draft -> tree -> verify -> accept -> commit.

Three methods share the loop and differ only in the tree they verify:
  ``ddtree`` the best-first tree of the ``budget`` most probable draft prefixes,
  ``dflash`` the drafter's argmax chain (linear speculative decoding),
  ``ar``     the root alone (plain autoregressive decoding; no drafter pass).
Greedy requests accept by walking the target's argmax; sampled ones by tree rejection sampling. Both
produce the same verdict and go through ``ddtree.commit``.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ddtree.commit import OutputState, TokenLogprobs, compact_kv_cache, new_kv_cache, token_logprobs
from ddtree.drafter import DFlashDrafter
from ddtree.errors import DDTreeError
from ddtree.models import check_pair, eos_token_ids, load_drafter, load_target
from ddtree.params import SamplingParams
from ddtree.sampling import sample_from_probs, sample_tree, target_probs_from_logits
from ddtree.tree import DraftTree, build_ddtree_tree, compile_ddtree_retrieve
from ddtree.verify import first_child_chain, follow_verified_tree, tree_verify_inputs

METHODS = ("ddtree", "dflash", "ar")
STAGES = ("draft", "tree", "compile", "verify", "accept", "commit")


def check_engine_options(
    method: str, budget: int, topk: int | None, has_drafter: bool
) -> tuple[str, int, int | None]:
    if method not in METHODS:
        raise DDTreeError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method != "ar" and not has_drafter:
        raise DDTreeError(f"method {method!r} needs a drafter; pass one or use method 'ar'")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise DDTreeError(f"budget must be an integer >= 1, got {budget!r}")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
        raise DDTreeError(f"topk must be an integer >= 1, got {topk!r}")
    return method, budget, topk


def _fast_low_precision(device: torch.device) -> torch.dtype:
    """bfloat16 where matmuls run it natively (CUDA with bf16, CPUs with AVX512-BF16), else float32."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    native = device.type == "cpu" and torch.cpu._is_avx512_bf16_supported()
    return torch.bfloat16 if native else torch.float32


def _with_mlp_dtype(drafter: DFlashDrafter, dtype: torch.dtype) -> DFlashDrafter:
    """``drafter``, or a copy of it whose MLP weights are ``dtype`` (the caller's module is left alone)."""
    if all(p.dtype == dtype for layer in drafter.layers for p in layer.mlp.parameters()):
        return drafter
    drafter = copy.deepcopy(drafter)
    for layer in drafter.layers:
        layer.mlp.to(dtype)
    return drafter


@dataclass
class GenerationStats:
    """What a response cost. ``acceptance_lengths`` has one entry per round: accepted drafts + 1."""

    method: str
    budget: int
    prompt_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length (tokens committed per target forward after prefill)."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "budget": self.budget,
            "prompt_tokens": self.prompt_tokens,
            "rounds": self.rounds,
            "tau": self.tau,
            "acceptance_lengths": list(self.acceptance_lengths),
            "stage_seconds": dict(self.stage_seconds),
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "decode_tokens": self.decode_tokens,
            "decode_tokens_per_second": self.decode_tokens_per_second,
        }


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # aligned with token_ids when requested


@dataclass
class StreamDelta:
    """What one round added: new token ids and the newly stable text (may be empty)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    stats: GenerationStats
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # aligned with token_ids when requested


@dataclass
class _Decode:
    """Per-request loop state: the target cache holds positions [0, start); the root sits at ``start``."""

    cache: DynamicCache
    draft_cache: object | None
    start: int
    root: int
    features: torch.Tensor | None  # [1, C, F * H] target features the drafter has not consumed yet
    generator: torch.Generator


class Engine:
    """Lossless speculative decoding of ``target`` with a DFlash ``drafter``."""

    def __init__(
        self,
        target,
        drafter: DFlashDrafter | None = None,
        tokenizer=None,
        method: str = "ddtree",
        budget: int = 64,
        topk: int | None = None,
        draft_dtype: torch.dtype | None = None,
    ) -> None:
        self.target = target.eval()
        self.tokenizer = tokenizer
        if drafter is not None:
            check_pair(target, drafter)
        self.method, self.budget, self.topk = check_engine_options(method, budget, topk, drafter is not None)
        self.device = next(target.parameters()).device
        self.dtype = next(target.parameters()).dtype
        self.embed = target.get_input_embeddings()
        self.decoder = target.get_decoder()  # the transformer without its LM head: logits = lm_head(hidden)
        self.lm_head = target.get_output_embeddings()
        # The drafter only proposes tokens, so rounding in its matmuls cannot change what is emitted. Its
        # LM head (a copy of the target's) and its MLPs, the largest matmuls of a draft pass, run in
        # `draft_dtype`: bf16 reads half the bytes and runs natively where supported (attention and norms
        # stay in the model's dtype: bf16 is slower there on CPUs).
        draft_dtype = draft_dtype or _fast_low_precision(self.device)
        self.draft_head = self.lm_head.weight.detach().to(draft_dtype)  # [V, H]
        self.draft_head_bias = (
            None if self.lm_head.bias is None else self.lm_head.bias.detach().to(draft_dtype)
        )
        self.drafter = None if drafter is None else _with_mlp_dtype(drafter.eval(), draft_dtype)
        self.eos_token_ids = eos_token_ids(target, tokenizer)
        self.max_positions = int(getattr(target.config, "max_position_embeddings", 1 << 30))

    @classmethod
    def from_pretrained(
        cls,
        target_dir: str | Path,
        drafter_dir: str | Path | None = None,
        method: str = "ddtree",
        budget: int = 64,
        topk: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Engine:
        check_engine_options(method, budget, topk, drafter_dir is not None)  # fail before loading weights
        target, tokenizer = load_target(target_dir, device=device, dtype=dtype)
        drafter = (
            load_drafter(drafter_dir).to(device=device, dtype=dtype) if drafter_dir is not None else None
        )
        return cls(target, drafter, tokenizer, method=method, budget=budget, topk=topk)

    # -- public API -------------------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        method: str | None = None,
        budget: int | None = None,
        topk: int | None = None,
    ) -> GenerationResult:
        token_ids, text, logprobs = [], "", []
        for delta in self.stream(prompt, params, method=method, budget=budget, topk=topk):
            token_ids += delta.token_ids
            text += delta.text
            logprobs += delta.logprobs
        return GenerationResult(token_ids, text, delta.finish_reason, delta.stats, logprobs)

    def stream(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        method: str | None = None,
        budget: int | None = None,
        topk: int | None = None,
    ) -> Iterator[StreamDelta]:
        """Yield one delta per round until the request finishes (the last one carries finish_reason)."""
        params = params or SamplingParams()
        method, budget, topk = check_engine_options(
            method or self.method,
            self.budget if budget is None else budget,
            self.topk if topk is None else topk,
            self.drafter is not None,
        )
        prompt_ids = self.encode(prompt)
        if len(prompt_ids) + params.max_new_tokens > self.max_positions:
            raise DDTreeError(
                f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the model's context of {self.max_positions} tokens"
            )
        output = OutputState(params, self.eos_token_ids, self.tokenizer)
        return self._stream(prompt_ids, params, method, budget, topk, output)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise DDTreeError("a text prompt needs a tokenizer; pass token ids instead")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise DDTreeError("prompt is empty")
        vocab = self.embed.num_embeddings
        if any(t < 0 or t >= vocab for t in ids):
            raise DDTreeError(f"prompt token ids must be in [0, {vocab})")
        return ids

    # -- the loop ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        method: str,
        budget: int,
        topk: int | None,
        output: OutputState,
    ) -> Iterator[StreamDelta]:
        stats = GenerationStats(method=method, budget=budget if method == "ddtree" else 0)
        stats.prompt_tokens = len(prompt_ids)
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(1 << 62)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        use_drafter = method != "ar"
        emitted_text = ""

        t0 = self._now()
        ids = torch.tensor([prompt_ids], device=self.device)  # [1, P]
        cache = new_kv_cache(self.target.config)
        hidden, features = self._target_forward(ids, None, None, cache, use_drafter)
        logits = self.lm_head(hidden[0, -1:])  # [1, V]
        root = self._pick(logits[0], params, generator)
        want_logprobs = params.logprobs is not None
        state = _Decode(
            cache,
            self.drafter.new_cache() if use_drafter else None,
            len(prompt_ids),
            root,
            features,
            generator,
        )
        output.write([root], token_logprobs(logits, [root], params.logprobs) if want_logprobs else None)
        stats.prefill_seconds = self._now() - t0
        delta = self._delta(output, 0, stats, emitted_text)
        emitted_text += delta.text  # the text streamed so far, without decoding it a second time
        yield delta

        while output.finish_reason is None:
            t_round = self._now()
            before = len(output.token_ids)
            nodes, tokens, hidden = self._round(state, params, method, budget, topk, stats)
            with self._stage(stats, "commit"):
                logprobs = None
                if want_logprobs:
                    logprobs = token_logprobs(self.lm_head(hidden[nodes]), tokens, params.logprobs)
                taken = output.write(tokens, logprobs)
                self._commit(state, nodes, tokens)
            stats.acceptance_lengths.append(len(tokens))
            stats.decode_seconds += self._now() - t_round
            stats.decode_tokens += taken
            delta = self._delta(output, before, stats, emitted_text)
            emitted_text += delta.text
            yield delta

    def _round(
        self,
        state: _Decode,
        params: SamplingParams,
        method: str,
        budget: int,
        topk: int | None,
        stats: GenerationStats,
    ) -> tuple[list[int], list[int], torch.Tensor]:
        """Draft, build the tree, verify it in one target forward and derive the accepted path.

        Returns the accepted nodes (root first), the emitted tokens (bonus last) and the target's final
        hidden states of the tree [N, H]: ``lm_head`` of row ``nodes[i]`` gives the distribution of
        ``tokens[i]``.
        """
        if method == "ar":
            tree = DraftTree.root_only(state.root)
        else:
            with self._stage(stats, "draft"):
                # A tree of `budget` nodes is at most `budget` deep: deeper rows would never be read.
                depth = self.drafter.block_size - 1 if method == "dflash" else budget
                draft_logits = self._draft(state, depth)  # [min(depth, block_size - 1), V]
            with self._stage(stats, "tree"):
                if method == "dflash":
                    tree = build_ddtree_tree(
                        draft_logits, draft_logits.shape[0], topk=1, root_token=state.root
                    )
                else:
                    tree = build_ddtree_tree(draft_logits, budget, topk=topk, root_token=state.root)
        with self._stage(stats, "compile"):
            ids, positions, mask = tree_verify_inputs(tree, state.start, self.device, self.dtype)
            retrieve = None if params.greedy else compile_ddtree_retrieve(tree.parents, tree.logw)
        with self._stage(stats, "verify"):
            hidden, features = self._target_forward(ids, positions, mask, state.cache, method != "ar")
            state.features = features
            hidden = hidden[0]  # [N, H]
            # The LM head closes the target forward. Sampling reads every node's distribution; the greedy
            # walk reads only the nodes it accepts.
            head = self._greedy_head(tree, hidden) if params.greedy else self.lm_head(hidden)  # [N, V]
        with self._stage(stats, "accept"):
            if params.greedy:
                return *follow_verified_tree(tree, head), hidden
            probs = target_probs_from_logits(head, params)  # [N, V]
            coins = torch.rand(tree.num_nodes, generator=state.generator, device=self.device)
            final_coin = torch.rand((), generator=state.generator, device=self.device)
            return *sample_tree(tree, retrieve, probs, coins, final_coin), hidden

    def _greedy_head(self, tree: DraftTree, hidden: torch.Tensor) -> Callable[[int], int]:
        """The target's argmax at node i, from the tree's final hidden states [N, H].

        On an accelerator one head over all N rows is one kernel and one transfer. On the CPU the head's
        cost grows with its rows, and the walk usually accepts along the first-child chain (the drafter's
        top token at each depth): those rows go through the head together, and a node off the chain gets
        its row when the walk reaches it (counted in the accept stage).
        """
        if self.device.type != "cpu":
            return self.lm_head(hidden).argmax(dim=-1).tolist().__getitem__
        chain = first_child_chain(tree)
        known = dict(zip(chain, self.lm_head(hidden[chain]).argmax(dim=-1).tolist(), strict=True))

        def target_token(i: int) -> int:
            if i not in known:
                known[i] = int(self.lm_head(hidden[i : i + 1]).argmax())
            return known[i]

        return target_token

    def _draft(self, state: _Decode, depth: int) -> torch.Tensor:
        """One drafter pass over [root, MASK x (block_size - 1)]; logits of its first ``depth`` drafts."""
        cache = state.draft_cache
        bs = self.drafter.block_size
        block = torch.full((1, bs), self.drafter.mask_token_id, device=self.device)
        block[0, 0] = state.root
        ctx_len = state.features.shape[1]
        ctx_start = cache.length
        hidden = self.drafter(
            self.embed(block),
            state.features,
            block_positions=torch.arange(state.start, state.start + bs, device=self.device)[None],
            ctx_positions=torch.arange(ctx_start, ctx_start + ctx_len, device=self.device)[None],
            cache=cache,
        )  # [1, bs, H]
        state.features = None
        hidden = hidden[0, 1 : 1 + depth].to(self.draft_head.dtype)  # [min(depth, bs - 1), H]
        return F.linear(hidden, self.draft_head, self.draft_head_bias).float()

    def _commit(self, state: _Decode, nodes: list[int], tokens: list[int]) -> None:
        num_nodes = state.cache.get_seq_length() - state.start
        compact_kv_cache(state.cache, state.start, num_nodes, nodes)
        if state.features is not None:  # [1, N, F * H] -> [1, m, F * H]; a first-child chain needs no gather
            if nodes[-1] == len(nodes) - 1:
                state.features = state.features[:, : len(nodes)]
            else:
                state.features = state.features.index_select(1, torch.tensor(nodes, device=self.device))
        state.start += len(nodes)
        state.root = tokens[-1]

    def _target_forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None,
        mask: torch.Tensor | None,
        cache: DynamicCache,
        need_features: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final hidden states [1, T, H] (before the LM head) and the drafter's features of the T tokens."""
        out = self.decoder(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            cache=cache,
            use_cache=True,
            output_hidden_states=need_features,
        )
        features = self.drafter.select_features(out.hidden_states) if need_features else None
        return out.last_hidden_state, features

    def _pick(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
        """The first token, straight from the prefill logits [V]."""
        if params.greedy:
            return int(logits.argmax())
        coin = torch.rand((), generator=generator, device=self.device)
        return sample_from_probs(target_probs_from_logits(logits, params), coin)

    def _delta(self, output: OutputState, before: int, stats: GenerationStats, emitted: str) -> StreamDelta:
        """What the output gained since it held ``before`` tokens and ``emitted`` text."""
        text = output.stable_text()
        return StreamDelta(
            token_ids=output.token_ids[before:],
            text=text[len(emitted) :],
            finish_reason=output.finish_reason,
            stats=stats,
            logprobs=output.logprobs[before:],
        )

    # -- timing -----------------------------------------------------------------------------------------

    def _now(self) -> float:
        if self.device.type == "cuda":  # stage times are only meaningful once the queued kernels finished
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def _stage(self, stats: GenerationStats, name: str):
        t = self._now()
        yield
        stats.stage_seconds[name] += self._now() - t
