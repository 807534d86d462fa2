"""Loading a target, its tokenizer and a DFlash drafter from local directories, and checking they fit."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from ddtree.errors import DDTreeError
from ddtree.model import quantization
from ddtree.model.checkpoint import materialize
from ddtree.model.tensor_parallel import shard_target
from ddtree.request.params import DTYPE_CHOICES  # resolve_dtype takes vLLM's aliases too
from ddtree.speculative.dflash2 import DFlash2Drafter
from ddtree.speculative.drafter import DFlashDrafter

log = logging.getLogger(__name__)

# Model types whose HF modules the engine's forward (ddtree.model.forward.TargetForward) runs exactly: GQA
# ones,
# GLM-4 MoE (partial rotary, q/k norms, qkv bias), and the MLA family (DeepSeek-V2/V3; Kimi K2's configs say
# kimi_k2, DeepSeek-V3's architecture; Kimi K2.5 / K2.6 are kimi_k25, a DeepSeek-V3 text backbone in a
# multimodal wrapper of which ddtree loads the text part).
SUPPORTED_MODEL_TYPES = (
    "qwen3",
    "qwen3_moe",
    "qwen2",
    "llama",
    "mistral",
    "glm4_moe",
    "deepseek_v2",
    "deepseek_v3",
    "kimi_k2",
    "kimi_k25",
)
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}  # a config's model_type -> the transformers class it is
TESTED_TRANSFORMERS = "5.24"  # the release ddtree's loaders are tested with (the MLA and GLM-4 MoE classes)
_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
ASSETS = Path(__file__).parents[1] / "assets" / "default"  # ddtree/assets
DEFAULT_TARGET = ASSETS / "target"
DEFAULT_DRAFTER = ASSETS / "drafter"


SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")  # what the engine is built and tested on


def check_device(name: str | torch.device) -> torch.device:
    """The torch device ``name`` names, or a one-line DDTreeError when it is unknown, of a kind the engine
    does not run on (mps, meta, ...), or absent from this machine."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise DDTreeError(f"unknown device {str(name)!r}; use cpu, cuda or cuda:N") from None
    if device.type not in SUPPORTED_DEVICE_TYPES:
        raise DDTreeError(f"device {str(name)!r} is not supported; ddtree runs on cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DDTreeError(f"device {str(name)!r} given but CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DDTreeError(f"device {str(name)!r} given but this machine has {count} CUDA device(s)")
    return device


def check_model_dir(directory: str | Path, what: str) -> Path:
    """``directory`` as a Path if it is one; otherwise say so, with a hint when it looks like a Hub id."""
    path = Path(directory)
    if path.is_dir():
        return path
    message = f"{what} directory {directory} does not exist"
    if len(path.parts) == 2 and not str(directory).startswith((".", "/", "~")):
        message += (
            f"; ddtree loads local directories: if {directory} is a Hugging Face Hub id, download it first "
            f"(hf download {directory} --local-dir DIR) and pass DIR"
        )
    raise DDTreeError(message)


def _read_config(directory: Path, what: str) -> dict:
    check_model_dir(directory, what)
    path = directory / "config.json"
    if not path.is_file():
        raise DDTreeError(f"{what} directory {directory} has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DDTreeError(f"{what} config {path} is not valid JSON: {exc.msg}") from None


# Below this many parameters a CPU decodes faster in float32 (matmuls small enough to be compute-bound);
# above it, bf16's halved weight bytes win (docs/benchmarks.md: without native bf16 matmuls the built-in
# 6M-parameter pair 0.74x in bf16, Qwen3-0.6B's shapes 1.65x). With them (AVX512-BF16) too: the built-in
# pair's plain decoding 0.86x in bf16 greedy and 0.65x seeded at T = 0.7 (a seeded bf16 row is computed
# batch-invariantly), and in bf16 a tree can round a near-tie another way than plain decoding does (the
# bench's T = 0 check failed 1 of 8 prompts; float32 passes it).
SMALL_MODEL_PARAMETERS = 100_000_000


def approximate_parameters(config: dict) -> int:
    """Parameters of a decoder from its config: embeddings plus per layer attention and MLP matrices."""
    h = int(config.get("hidden_size", 0))
    inter = int(config.get("intermediate_size", 4 * h))
    layers = int(config.get("num_hidden_layers", 0))
    return int(config.get("vocab_size", 0)) * h + layers * (4 * h * h + 3 * h * inter)


def resolve_dtype(
    name: str | torch.dtype | None, config: dict, device: str | torch.device = "cpu"
) -> torch.dtype:
    """The dtype to load weights in: ``name`` (vLLM's names and aliases), or for "auto" (and None) the
    checkpoint's own ``dtype`` / ``torch_dtype`` (float32 if absent). On a CPU "auto" gives float32 for a
    small half-precision checkpoint (``SMALL_MODEL_PARAMETERS``): half precision only pays there where the
    weights' bytes dominate."""
    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        stored = config.get("dtype") or config.get("torch_dtype") or "float32"
        dtype = _DTYPES.get(str(stored).removeprefix("torch."))
        if dtype is None:
            raise DDTreeError(
                f"checkpoint dtype {stored!r} is not one of {', '.join(DTYPE_CHOICES[1:])}; pass a dtype"
            )
        on_cpu = torch.device(device).type == "cpu"
        if dtype != torch.float32 and on_cpu and approximate_parameters(config) < SMALL_MODEL_PARAMETERS:
            return torch.float32
        return dtype
    dtype = _DTYPES.get(str(name).lower())
    if dtype is None:
        raise DDTreeError(
            f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)} "
            "(or bf16, fp16, half, fp32, float)"
        )
    return dtype


def _sliding_window(config: dict) -> int | None:
    """The attention window in effect, as HF reads it: Qwen's ``use_sliding_window: false`` turns
    ``sliding_window`` off; Mistral has no such switch, so a non-null window is on."""
    return config.get("sliding_window") if config.get("use_sliding_window", True) else None


def check_target_attention(config: dict, name: str | Path, max_model_len: int | None = None) -> None:
    """Refuse a target whose attention the engine's full-attention forward would not reproduce: a window
    shorter than the context it can see (``max_model_len``, else ``max_position_embeddings``), or a layer
    type other than full/sliding attention."""
    other = sorted(set(config.get("layer_types") or []) - {"full_attention", "sliding_attention"})
    if other:
        raise DDTreeError(
            f"target {name} has layer types {', '.join(other)}; ddtree runs full attention only"
        )
    window = _sliding_window(config)
    context = max_model_len or config.get("max_position_embeddings") or 1 << 30
    if window is not None and window < context:
        raise DDTreeError(
            f"target {name} uses sliding-window attention (window {window} < context {context}); "
            f"ddtree runs full attention only: pass --max-model-len {window} or less"
        )


def check_drafter_attention(config: dict, name: str | Path, max_model_len: int | None = None) -> None:
    """Refuse a drafter config whose attention ``DFlashDrafter`` (full and bidirectional over context and
    block) would not reproduce. DFlash's reference makes ``sliding_attention`` layers causal unless the
    config says ``is_causal: false``; a window is exact when it covers the whole context (``max_model_len``,
    else the drafter's ``max_position_embeddings``) plus one block."""
    kinds = list(dict.fromkeys(config.get("layer_types") or ["full_attention"]))
    is_causal = config.get("is_causal")
    if is_causal:
        raise DDTreeError(
            f"drafter {name} has causal attention (is_causal: true); ddtree's drafter is bidirectional"
        )
    if kinds == ["full_attention"]:
        return
    window = _sliding_window(config)
    described = f"drafter {name} has layer types {', '.join(kinds)} (sliding window {window})"
    if set(kinds) - {"full_attention", "sliding_attention"}:
        raise DDTreeError(f"{described}; ddtree's drafter runs full attention only")
    if is_causal is None:
        raise DDTreeError(
            f"{described}, causal as the config sets no is_causal: false; "
            "ddtree's drafter runs bidirectional full attention only"
        )
    block = int(config.get("block_size") or (config.get("dflash_config") or {}).get("block_size") or 0)
    context = (max_model_len or config.get("max_position_embeddings") or 1 << 30) + block
    if window is not None and window < context:
        raise DDTreeError(
            f"{described}: window {window} < context {context} (max_model_len + block size {block}); "
            f"ddtree's drafter runs full attention only: pass --max-model-len {window - block} or less"
        )


def load_target(
    directory: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = torch.float32,
    max_model_len: int | None = None,
    trust_remote_code: bool = False,
    tokenizer: bool = True,
    shard: tuple[int, int] | None = None,
):
    """A causal LM of a type in SUPPORTED_MODEL_TYPES and its tokenizer (None when the directory has
    none, or ``tokenizer`` is False). ``dtype`` goes through resolve_dtype ("auto" included);
    ``max_model_len`` is the longest sequence the engine will run, which decides whether a sliding window
    is exact. The model is always transformers' own class (never a checkpoint's code: the engine's forward
    runs its modules); ``trust_remote_code`` lets the tokenizer run the checkpoint's code.

    ``shard`` (rank, world size) loads one tensor-parallel rank's shard, reading only its slices
    (``ddtree.model.checkpoint``); so does a quantized checkpoint at any size, dequantized at load. A float
    checkpoint in one process goes through ``from_pretrained``."""
    directory = Path(directory)
    config = _read_config(directory, "target")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise DDTreeError(
            f"target {directory} has model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    hf_type = MODEL_TYPE_ALIASES.get(model_type, model_type)
    if hf_type not in CONFIG_MAPPING_NAMES:
        raise DDTreeError(
            f"target {directory} has model_type {model_type!r}, which transformers "
            f"{transformers.__version__} does not implement; install transformers>={TESTED_TRANSFORMERS} "
            "(pip install -U transformers)"
        )
    text_config = (config.get("text_config") or {}) if hf_type == "kimi_k25" else config
    check_target_attention(text_config, directory, max_model_len)
    stored = {k: config[k] for k in ("dtype", "torch_dtype") if config.get(k)}  # a wrapper's, else the text's
    dtype = resolve_dtype(dtype, text_config | stored, device)
    scheme = quantization.scheme(config)
    try:
        if shard is not None or scheme is not None:
            model = _load_slicewise(directory, config, hf_type, dtype, device, shard, scheme)
        elif hf_type == "kimi_k25":
            model = text_backbone(AutoModelForImageTextToText.from_pretrained(directory, dtype=dtype))
        elif hf_type != model_type:
            fields = {k: v for k, v in config.items() if k != "model_type"}
            hf_config = AutoConfig.for_model(hf_type, **fields)
            model = AutoModelForCausalLM.from_pretrained(directory, config=hf_config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    except DDTreeError:  # already one line naming the cause (a shard that cannot split, a bad tensor)
        raise
    except (OSError, ValueError, TypeError) as exc:
        raise DDTreeError(f"cannot load target from {directory}: {str(exc).splitlines()[0]}") from None
    model = model.to(device)
    return model.eval(), load_tokenizer(directory, trust_remote_code) if tokenizer else None


def _load_slicewise(directory: Path, config: dict, hf_type: str, dtype, device, shard, scheme):
    """The target built on the meta device, sharded there (``shard``: rank, world size), then read slice
    by slice into ``dtype`` (``ddtree.model.checkpoint.materialize``); the start-up log says what it read."""
    fields = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config")}
    if hf_type == "kimi_k25":
        fields["text_config"] = {k: v for k, v in fields["text_config"].items() if k != "quantization_config"}
    hf_config = AutoConfig.for_model(hf_type, **fields)
    with torch.device("meta"):
        if hf_type == "kimi_k25":
            built = AutoModelForImageTextToText.from_config(hf_config, dtype=dtype)
        else:
            built = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model = text_backbone(built) if hf_type == "kimi_k25" else built
    if shard is not None and shard[1] > 1:
        shard_target(model, *shard)
    stats = materialize(model, built, directory, scheme, dtype, device)
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    model.load_stats = stats
    where = f"tensor-parallel rank {shard[0]} of {shard[1]}" if shard else "target"
    log.info("%s: %s", where, stats.summary())
    return model


def load_tokenizer(directory: Path, trust_remote_code: bool = False):
    """The directory's tokenizer (None without one). One that ships as code (Kimi's tiktoken tokenizer)
    runs only with ``trust_remote_code``; without it, a one-line error saying to pass it."""
    if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        return AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code" not in str(exc):
            reason = str(exc).splitlines()[0]
            raise DDTreeError(f"cannot load the tokenizer in {directory}: {reason}") from None
        raise DDTreeError(
            f"the tokenizer in {directory} ships as code in the checkpoint: pass --trust-remote-code "
            "(Engine.from_pretrained(trust_remote_code=True)) to run it, if you trust its source"
        ) from None


def text_backbone(model):
    """Kimi K2.5 / K2.6 (``Kimi_K25ForConditionalGeneration``) as the DeepSeek-V3 causal LM it wraps: its
    language model and LM head (the same modules, nothing copied); the vision tower and projector are
    dropped with the wrapper. ``media_token_ids`` holds the image/video placeholder ids a prompt must not
    carry: without the vision tower they would embed as token 0 (HF's wrapper does that) and decode
    something other than what the model would for the image."""
    config = model.config
    with torch.device("meta"):  # the modules come from ``model``; the meta ones are never allocated
        causal = AutoModelForCausalLM.from_config(config.text_config)
    causal.model = model.model.language_model
    causal.lm_head = model.lm_head
    causal.generation_config = model.generation_config
    causal.media_token_ids = frozenset((config.image_token_id, config.video_token_id))
    return causal


def media_token_ids(target) -> frozenset[int]:
    """Placeholder ids of images and videos a text-only target refuses in a prompt (``text_backbone``)."""
    return getattr(target, "media_token_ids", frozenset())


# The drafter class of each public architecture name a drafter config.json may carry.
DRAFTER_ARCHITECTURES = {"DFlashDraftModel": DFlashDrafter, "DFlash2DraftModel": DFlash2Drafter}


def load_drafter(directory: str | Path, max_model_len: int | None = None) -> DFlashDrafter:
    """A DFlash or DFlash2 drafter (by the config's ``architectures``); ``max_model_len`` as for
    load_target (a sliding window must cover it + a block)."""
    directory = Path(directory)
    config = _read_config(directory, "drafter")
    named = [
        DRAFTER_ARCHITECTURES[a] for a in config.get("architectures") or [] if a in DRAFTER_ARCHITECTURES
    ]
    if not named:
        raise DDTreeError(
            f"drafter {directory} is not a DFlash checkpoint (architectures must name "
            f"{' or '.join(DRAFTER_ARCHITECTURES)})"
        )
    check_drafter_attention(config, directory, max_model_len)
    return named[0].from_pretrained(directory)


# A mask embedding row whose norm is below this share of a typical row's is "near zero": an untrained
# reserved token, whose MASK positions then carry no signal (SGLang #27924: accept length 1.42 against 6.3).
MASK_ROW_FLOOR = 0.01


def check_pair(target, drafter: DFlashDrafter, tokenizer=None) -> None:
    """Refuse a drafter built for another target: it would run, draft garbage and hide the mistake. Warn
    (a log line naming the cause) about what runs losslessly but kills acceptance: a drafter vocabulary
    other than the target's, a MASK token whose embedding row is near zero, or one that is the pad or
    EOS id."""
    tc, dc = target.config, drafter.config
    embedding = target.get_input_embeddings()
    vocab = embedding.num_embeddings
    if dc.hidden_size != tc.hidden_size:
        raise DDTreeError(
            f"drafter hidden size {dc.hidden_size} does not match the target's {tc.hidden_size}"
        )
    if dc.num_target_layers != tc.num_hidden_layers:
        raise DDTreeError(
            f"drafter was trained for a {dc.num_target_layers}-layer target; "
            f"this target has {tc.num_hidden_layers}"
        )
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < tc.num_hidden_layers]
    if bad:
        raise DDTreeError(
            f"drafter target_layer_ids {bad} are outside the target's {tc.num_hidden_layers} layers"
        )
    mask = drafter.mask_token_id
    if mask is None or not 0 <= mask < vocab:
        raise DDTreeError(f"drafter mask_token_id {mask!r} is missing or outside the vocabulary")
    if drafter.block_size < 2:
        raise DDTreeError(f"drafter block_size must be >= 2, got {drafter.block_size}")
    if dc.vocab_size != vocab:
        # The drafter embeds and reads out through the target's own embedding and LM head, so a vocabulary
        # padded to another size changes nothing; one trained for another tokenizer drafts poorly.
        log.warning(
            "drafter vocabulary %d differs from the target's %d: drafts use the target's embedding and LM "
            "head (all %d tokens; output stays lossless), but if the drafter was trained with another "
            "tokenizer, expect low acceptance",
            dc.vocab_size,
            vocab,
            vocab,
        )
    weight = embedding.weight.detach()
    norms = weight[:: max(1, vocab // 4096)].float().norm(dim=-1)  # [<= 4096 + 1] rows spread evenly
    row = float(weight[mask].float().norm())
    if row < MASK_ROW_FLOOR * float(norms.median()):
        log.warning(
            "drafter mask_token_id %d has a near-zero embedding row in the target (norm %.3g, typical "
            "%.3g): an untrained token; expect very low acceptance (use the mask token the drafter was "
            "trained with)",
            mask,
            row,
            float(norms.median()),
        )
    pad = getattr(tc, "pad_token_id", None)
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        pad = tokenizer.pad_token_id
    for name, ids in (("pad", {pad}), ("EOS", eos_token_ids(target, tokenizer))):
        if mask in ids:
            log.warning(
                "drafter mask_token_id %d is the target's %s token id: the drafter's MASK positions then "
                "look like real %s tokens; expect low acceptance (use a dedicated mask token)",
                mask,
                name,
                name,
            )


def eos_token_ids(target, tokenizer=None) -> frozenset[int]:
    """End-of-sequence ids the way HF generate() sees them, plus the tokenizer's own."""
    ids: set[int] = set()
    for source in (getattr(target, "generation_config", None), target.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
            break
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
