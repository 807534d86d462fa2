"""The training commands' configurations: every field a flag (``flags.add_dataclass_flags``), checked
where it is made. Kept apart from the trainers so that building the command line imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from ddtree.errors import DDTreeError
from ddtree.training.flags import check_config

MAX_LENGTH = 2048


TARGET_HELP = {
    "hidden_size": "model width",
    "num_layers": "transformer layers",
    "num_heads": "attention heads",
    "num_kv_heads": "key/value heads (grouped-query attention)",
    "head_dim": "dimension per attention head",
    "intermediate_size": "MLP width",
    "seq_len": "tokens per training sequence",
    "eval_every": "evaluate held-out loss every N steps; 0 = only at the end",
}


@dataclass(frozen=True)
class TargetConfig:
    """Model shape and optimisation schedule; everything a resumed run must agree on except ``RUN_FIELDS``."""

    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 2600
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    bf16_autocast: bool = True  # ~1.4x faster on AVX512-BF16 CPUs; master weights stay fp32
    ckpt_every: int = 200
    eval_every: int = 0  # 0: evaluate held-out loss only at the end
    save_dtype: str = "bfloat16"
    max_minutes: float = 0.0  # 0: no limit; else the schedule ends early when training time runs out

    def __post_init__(self) -> None:
        positive = (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "seq_len",
            "batch_size",
            "steps",
            "lr",
            "ckpt_every",
        )
        check_config(self, positive)
        if self.num_heads % self.num_kv_heads:
            heads = f"num_heads {self.num_heads}, num_kv_heads {self.num_kv_heads}"
            raise DDTreeError(f"num_heads must be a multiple of num_kv_heads, got {heads}")
        if self.seq_len > MAX_LENGTH:
            raise DDTreeError(f"seq_len must be <= {MAX_LENGTH}, got {self.seq_len}")
        if min(self.warmup_steps, self.eval_every, self.max_minutes) < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise DDTreeError("warmup_steps, eval_every, max_minutes must be >= 0 and min_lr_ratio in [0, 1]")


DRAFTER_HELP = {
    "num_layers": "drafter transformer layers",
    "block_size": "tokens per draft block (the root and block_size - 1 drafts)",
    "target_layer_ids": "comma-separated target layers to take features from; '' = DFlash's rule",
    "mask_token_id": "token id of the mask placeholder; -1 = the tokenizer's <|mask|>",
    "gamma": "loss decay over block positions; 0 = DFlash's value for the block size (7 for 16)",
    "num_sequences": "target continuations to generate as training data",
    "prompt_min": "shortest prompt, in tokens",
    "prompt_max": "longest prompt, in tokens",
    "continuation": "tokens the target continues each prompt with",
    "sample_fraction": "share of generation batches sampled at T=1 (the rest greedy)",
    "gen_batch_size": "prompts per target generation batch",
    "anchors": "blocks per sequence per step (random anchor positions)",
    "eval_prompts": "held-out prompts for the final tau evaluation; 0 = skip it",
    "eval_prompt_len": "tokens per held-out prompt",
    "eval_new_tokens": "tokens generated per held-out prompt",
    "eval_budget": "ddtree budget of the final evaluation",
    "architecture": "drafter family: dflash, or dflash2 (grouped convolutions and a candidate selector)",
    "objective": "what the drafter learns of the target: argmax (its tokens), kl (its whole "
    "distribution at --distill-temperature) or both (the two losses added)",
    "distill_temperature": "temperature of the target distribution the kl objective distils",
    "init_from": "start from this drafter directory (its shape wins: layers, block, feature layers, mask "
    "token); dflash2 from a DFlash drafter starts as that drafter (identity convolutions)",
    "conv_kernel_size": "dflash2: taps of the grouped dynamic convolution over the block",
    "conv_group_size": "dflash2: channels per convolution group",
    "selector_rank": "dflash2: rank of the candidate selector's codebooks",
    "selector_top_k": "dflash2: candidates per block position the selector re-scores",
}


ARCHITECTURES = ("dflash", "dflash2")
OBJECTIVES = ("argmax", "kl", "both")


@dataclass(frozen=True)
class DrafterConfig:
    """Drafter shape, data and optimisation; a resumed run must agree on all but ``RUN_FIELDS``."""

    num_layers: int = 1
    block_size: int = 16
    target_layer_ids: str = ""  # comma-separated target layers to take features from; "" = DFlash's rule
    mask_token_id: int = -1  # -1: the tokenizer's <|mask|>
    gamma: float = 0.0  # loss decay; 0 = DFlash's value for the block size (7 for 16, 5 for 10, 4 for 8)
    # data: the target's continuations of prompts
    num_sequences: int = 4096
    prompt_min: int = 32
    prompt_max: int = 128
    continuation: int = 128
    sample_fraction: float = 0.5  # share of generation batches sampled at T=1 (the rest greedy)
    gen_batch_size: int = 64
    # optimisation
    batch_size: int = 8  # sequences per step
    anchors: int = 16  # blocks per sequence per step
    steps: int = 2000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    bf16_autocast: bool = True  # drafter forward/backward in bf16 on CPU; master weights stay fp32
    ckpt_every: int = 200
    save_dtype: str = "bfloat16"
    max_minutes: float = 0.0  # 0: no limit; else the schedule ends early when training time runs out
    # final evaluation: tau of dflash and ddtree on held-out prompts, greedy
    eval_prompts: int = 16  # 0: skip the evaluation
    eval_prompt_len: int = 64
    eval_new_tokens: int = 128
    eval_budget: int = 32
    # the drafter family and the objective
    architecture: str = "dflash"  # or "dflash2"
    objective: str = "argmax"  # or "kl": the target's whole distribution; "both": the two losses added
    distill_temperature: float = 1.0
    init_from: str = ""  # a drafter directory to start from; "" = fresh weights
    conv_kernel_size: int = 4
    conv_group_size: int = 32
    selector_rank: int = 32
    selector_top_k: int = 8

    def __post_init__(self) -> None:
        positive = (
            "num_layers",
            "prompt_min",
            "prompt_max",
            "continuation",
            "num_sequences",
            "gen_batch_size",
            "batch_size",
            "anchors",
            "steps",
            "lr",
            "ckpt_every",
            "eval_prompt_len",
            "eval_new_tokens",
            "eval_budget",
            "distill_temperature",
            "conv_kernel_size",
            "conv_group_size",
            "selector_rank",
            "selector_top_k",
        )
        check_config(self, positive)
        for name, allowed in (("architecture", ARCHITECTURES), ("objective", OBJECTIVES)):
            if getattr(self, name) not in allowed:
                raise DDTreeError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.block_size < 2:
            raise DDTreeError(f"block_size must be >= 2, got {self.block_size}")
        if self.prompt_min > self.prompt_max:
            raise DDTreeError(f"prompt_min {self.prompt_min} must be <= prompt_max {self.prompt_max}")
        if not 0 <= self.sample_fraction <= 1 or not 0 <= self.min_lr_ratio <= 1:
            raise DDTreeError("sample_fraction and min_lr_ratio must be in [0, 1]")
        if min(self.warmup_steps, self.max_minutes, self.gamma, self.eval_prompts, self.weight_decay) < 0:
            raise DDTreeError("warmup_steps, max_minutes, gamma, eval_prompts, weight_decay must be >= 0")
        self.layer_ids()  # validates the syntax

    def layer_ids(self) -> list[int] | None:
        if not self.target_layer_ids.strip():
            return None
        try:
            return [int(x) for x in self.target_layer_ids.split(",")]
        except ValueError:
            raise DDTreeError(
                f"target_layer_ids must be comma-separated integers, got {self.target_layer_ids!r}"
            ) from None
