"""A model's configuration and its data types: what every other part of ``llmlab.memory`` reads.

Part of ``llmlab.memory`` (its ``__init__`` says how the parts fit); read them in the order model, weights,
kv, planner.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from llmlab.serve.paths import MODELS_DIR, TINY_NAME

GB = 10**9
GiB = 2**30

CONFIGS_DIR = MODELS_DIR / "configs"

# The Hugging Face repository behind each shipped config, for the `vllm serve` line.
HF_IDS = {
    "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "llama3.1-405b": "meta-llama/Llama-3.1-405B-Instruct",
    "llama3.1-405b-fp8": "meta-llama/Llama-3.1-405B-Instruct-FP8",
    "llama2-7b": "meta-llama/Llama-2-7b-hf",
    "llama2-70b": "meta-llama/Llama-2-70b-hf",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "kimi-k2": "moonshotai/Kimi-K2-Instruct",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "gpt-oss-120b": "openai/gpt-oss-120b",
    "gemma2-9b": "google/gemma-2-9b",
    "gemma3-1b": "google/gemma-3-1b-it",
    "llama4-scout": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "llama4-maverick": "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
}

# vLLM's default KV block size (tokens per block) per platform: 16 on CUDA (CacheConfig's default),
# 128 on its CPU backend (vllm/platforms/cpu.py sets it when the user gives none).
GPU_BLOCK_SIZE = 16
CPU_BLOCK_SIZE = 128
# vLLM 0.32's reference CPU latent-attention kernel (CPU_MLA) compiles for 16-token blocks only (platforms/cpu.py);
# on a CPU with AMX tiles vLLM prefers AMX_MLA (bf16 weights only, default blocks) unless CPU_MLA is asked for.
CPU_MLA_BLOCK_SIZE = 16

# vLLM's default share of a GPU's memory that it may use (weights + activations + KV cache).
DEFAULT_UTILIZATION = 0.9

# Per-GPU allowance for what vLLM measures at start-up and subtracts before sizing the KV cache: the
# peak activation of a profiling forward pass (one chunk of max_num_batched_tokens, so it hardly grows
# with context length thanks to chunked prefill), non-torch memory (CUDA context, NCCL buffers), and an
# estimate of the CUDA graphs' memory (subtracted by default in vLLM 0.32's source,
# VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1; vLLM 0.26 left the graphs to the 1 - utilization share).
# Measured, Llama 3.1 8B: one H100, 1.1 + 0.22 + 0.98 (graphs) GiB; two H200s (TP=2), 0.71 + 0.07 + 0.72
# GiB per GPU.  3 GiB covers those with a margin for larger hidden sizes.
DEFAULT_OVERHEAD_GIB = 3.0


class ConfigError(ValueError):
    """A model config is missing a field, has an odd value, or describes an unsupported model."""


class UnknownName(ConfigError, KeyError):
    """A name (model, dtype, GPU) that llmlab does not know; the message lists the known ones."""

    __str__ = Exception.__str__


class UnsupportedArchitecture(ConfigError):
    """An architecture llmlab has no per-tensor formulas for: transformers can still count its parameters
    (:func:`~llmlab.memory.transformers_param_count`), but llmlab does not guess its KV cache or layout."""


class PlanError(ValueError):
    """No layout fits the request; the message says what to change."""


# --------------------------------------------------------------------------------------------------
# Data types
# --------------------------------------------------------------------------------------------------

# Bits per stored value.  int4 counts only the 4-bit values: real int4 formats (GPTQ, AWQ) also store
# a 16-bit scale (and often a zero point) per group of 32-128 weights: +3 to +13 % on top, and they
# keep embeddings, norms and usually the LM head in 16 bits.
DTYPE_BITS = {"float32": 32, "bfloat16": 16, "float16": 16, "fp8": 8, "int8": 8, "int4": 4}
DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
    "half": "float16", "f16": "float16", "float8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "e4m3": "fp8",
}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")


def normalize_dtype(dtype: str) -> str:
    """Canonical weight dtype name (``bf16`` -> ``bfloat16``); an unknown name is an error, not a guess."""
    key = str(dtype).strip().lower()
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BITS:
        raise UnknownName(f"Unknown dtype {dtype!r}. Use one of {', '.join(DTYPE_BITS)} "
                          f"(or an alias: {', '.join(DTYPE_ALIASES)}).")
    return key


def bytes_per_param(dtype: str) -> float:
    """Bytes one stored value takes: 4, 2, 1 or 0.5."""
    return DTYPE_BITS[normalize_dtype(dtype)] / 8


def serve_dtype(model, dtype: str | None = None) -> str:
    """The dtype vLLM computes in (its ``--dtype``), which is also the KV cache's dtype under "auto".

    ``dtype=None`` serves the checkpoint as stored (a float32 checkpoint in float32, as llmlab's
    embedded server does with ``--dtype float32``; vLLM's own "auto" would downcast it to bfloat16).
    A quantized weight dtype (fp8, int8, int4) keeps 16-bit activations: the checkpoint's, or bfloat16.
    """
    spec = model_spec(model)
    if dtype is not None:
        dtype = normalize_dtype(dtype)
        if dtype in FLOAT_DTYPES:
            return dtype
    base = spec.require_dtype()
    if dtype is None:
        return base
    return base if DTYPE_BITS[base] == 16 else "bfloat16"


def normalize_kv_dtype(kv_dtype: str) -> str:
    """Canonical KV cache dtype name, as vLLM's ``--kv-cache-dtype`` spells it (``bf16`` -> ``bfloat16``)."""
    key = str(kv_dtype).strip().lower()
    key = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(key, key)
    if key not in KV_DTYPES:
        raise UnknownName(f"Unknown KV cache dtype {kv_dtype!r}. vLLM's --kv-cache-dtype takes "
                          f"{', '.join(k for k in KV_DTYPES if k != 'float32')} (float32 only via --dtype float32).")
    return key


def kv_dtype_bytes(model, kv_dtype: str = "auto", dtype: str | None = None) -> int:
    """Bytes per stored K or V value: ``auto`` follows :func:`serve_dtype`; fp8 variants take 1 byte."""
    key = normalize_kv_dtype(kv_dtype)
    if key == "auto":
        return DTYPE_BITS[serve_dtype(model, dtype)] // 8
    return 1 if key.startswith("fp8") else DTYPE_BITS[key] // 8


# --------------------------------------------------------------------------------------------------
# Reading a config
# --------------------------------------------------------------------------------------------------

ARCHITECTURES = {  # Hugging Face class -> family; the formulas below are exact for these only.
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",  # also Kimi K2's
    "GptOssForCausalLM": "gpt_oss",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",  # Gemma 3 1B; the larger ones are vision-language models
    "Llama4ForCausalLM": "llama4_text",  # Llama4ForConditionalGeneration: its text_config (see _language_model)
}
# Vision-language models whose language model llmlab reads from the config's text_config.
VISION_LANGUAGE = {"Llama4ForConditionalGeneration": "Llama4ForCausalLM"}
GEMMA = ("gemma2", "gemma3_text")  # four norms per layer (before and after attention and MLP), tied embeddings
QWEN3 = ("qwen3", "qwen3_moe")  # Llama's layout plus an RMSNorm on each head's queries and keys
DEEPSEEK = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention, shared + routed experts


def shipped_models() -> list[str]:
    """Names accepted wherever a model is asked for: the shipped configs and the tiny model."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json")) + [TINY_NAME]


def config_path(name: str) -> Path:
    """Where a shipped model's ``config.json`` lives."""
    if name == TINY_NAME:
        return MODELS_DIR / TINY_NAME / "config.json"
    return CONFIGS_DIR / f"{name}.json"


def load_config(model) -> tuple[dict, str]:
    """Return ``(config dict, where it came from)`` for a dict, a shipped name, a file or a directory."""
    if isinstance(model, Mapping):
        return dict(model), "dict"
    if not isinstance(model, str | Path):
        raise ConfigError(f"A model is a shipped name, a path to a config.json, or a dict; got {type(model).__name__}.")
    text = str(model)
    if text in shipped_models():
        path = config_path(text)
        if not path.is_file():
            raise ConfigError(f"The shipped model {text!r} has no config at {path} (the tiny model's files come "
                              "with its weights): reinstall llmlab, or pass a config.json path.")
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise UnknownName(f"{text!r} is neither a shipped model ({', '.join(shipped_models())}) nor a "
                              "config.json file or model directory.")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); it should be a Hugging Face config.json.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a JSON {type(data).__name__}, not an object: not a config.json.")
    return data, str(path)


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts the arithmetic needs, validated.  Hashable, so results can be cached."""

    name: str
    family: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    num_experts: int = 0            # 0: a dense MLP; otherwise the experts of each mixture-of-experts layer
    experts_per_token: int = 0
    expert_width: int = 0           # one expert's MLP width (Mixtral: intermediate_size; Qwen3-MoE: its own)
    dense_layers: frozenset[int] = frozenset()  # layers of an MoE model that keep a dense MLP
    qk_norm: bool = False           # Qwen3: an RMSNorm of head_dim weights on queries and on keys
    shared_experts: int = 0         # DeepSeek: experts every token runs, beside the routed ones
    expert_bias: bool = False       # gpt-oss: biases on the router and on each expert's matrices
    attention_sinks: bool = False   # gpt-oss: one learned "sink" logit per attention head
    sandwich_norms: bool = False    # Gemma: a norm after attention and one after the MLP too
    sliding_layers: frozenset[int] = frozenset()  # layers that attend to the last sliding_window tokens only
    # Multi-head latent attention (DeepSeek): queries through a rank-q_lora_rank bottleneck (0: none), keys and
    # values through one latent of kv_lora_rank values plus a shared rotary key of qk_rope_head_dim; head_dim is
    # then the query/key width per head (nope + rope) and v_head_dim the value's.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    quant_block: tuple[int, int] | None = None  # fp8 with one scale per block of weights (DeepSeek-V3: 128 x 128)
    max_position_embeddings: int | None = None
    torch_dtype: str | None = None
    sliding_window: int | None = None
    quant_method: str | None = None
    not_quantized: frozenset[str] = frozenset()
    hf_id: str | None = None
    source: str = ""
    defaults_applied: tuple[str, ...] = ()

    def require_dtype(self) -> str:
        """The checkpoint's dtype; a config without one gets an error, never an assumed float32."""
        if self.torch_dtype is None:
            raise ConfigError(f"{self.name}: the config has no torch_dtype (or dtype) field, so the checkpoint's "
                              "bytes are unknown. Pass dtype='bfloat16' (or another) explicitly.")
        return self.torch_dtype

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.num_experts) and layer not in self.dense_layers

    def require_context(self) -> int:
        if self.max_position_embeddings is None:
            raise ConfigError(f"{self.name}: the config has no max_position_embeddings; pass a context length.")
        return self.max_position_embeddings


def _int_field(cfg: dict, key: str, name: str) -> int:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{name}: the config has no {key!r} field; a {cfg.get('model_type', 'decoder')} "
                          f"config.json needs it (check the file is the model's config.json).")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}: config field {key!r} should be a positive integer, got {value!r} "
                          f"({type(value).__name__}).")
    return value


def _bool_field(cfg: dict, key: str, default: bool, name: str, applied: list[str]) -> bool:
    if key not in cfg:
        applied.append(f"{key}={default} (transformers' default: absent from the config)")
        return default
    if not isinstance(cfg[key], bool):
        raise ConfigError(f"{name}: config field {key!r} should be true or false, got {cfg[key]!r}.")
    return cfg[key]


def _family(cfg: dict, name: str) -> tuple[str, str]:
    archs = cfg.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not archs or not isinstance(archs[0], str)):
        raise ConfigError(f"{name}: 'architectures' should be a list of class names, got {archs!r}.")
    if archs:
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"{name}: architecture {arch!r} is not supported by llmlab.memory (supported: "
                f"{', '.join(ARCHITECTURES)}). Its layout differs, so llmlab does not guess its KV cache.")
        return ARCHITECTURES[arch], arch
    model_type = cfg.get("model_type")
    by_type = {family: arch for arch, family in ARCHITECTURES.items()}
    if model_type in by_type:
        return model_type, by_type[model_type]
    raise UnsupportedArchitecture(
        f"{name}: the config names neither a supported 'architectures' entry nor a supported 'model_type' "
        f"(got {model_type!r}); supported: {', '.join(ARCHITECTURES)}.")


def _torch_dtype(cfg: dict, name: str) -> str | None:
    raw = cfg.get("torch_dtype", cfg.get("dtype"))  # transformers >= 5 writes "dtype"
    if raw is None:
        return None
    try:
        dtype = normalize_dtype(str(raw).removeprefix("torch."))
    except UnknownName:
        raise ConfigError(f"{name}: torch_dtype {raw!r} is not a dtype llmlab knows "
                          f"({', '.join(FLOAT_DTYPES)}).") from None
    if dtype not in FLOAT_DTYPES:
        raise ConfigError(f"{name}: torch_dtype {raw!r} should be a float type ({', '.join(FLOAT_DTYPES)}).")
    return dtype


def _head_dim(cfg: dict, hidden: int, heads: int, name: str, family: str, applied: list[str]) -> int:
    if cfg.get("head_dim") is not None:  # explicit (e.g. Mistral Nemo: 128 while 5120 / 32 = 160)
        return _int_field(cfg, "head_dim", name)
    if family in QWEN3 or family in GEMMA:  # their configs' defaults, whatever hidden_size / heads is
        default = 128 if family in QWEN3 else 256
        applied.append(f"head_dim={default} ({family}'s config default: absent from the config)")
        return default
    if hidden % heads:
        raise ConfigError(f"{name}: hidden_size {hidden} is not divisible by num_attention_heads {heads} and the "
                          "config gives no head_dim: add the model's head_dim.")
    return hidden // heads


def _sliding_window(cfg: dict, family: str, layers: int, name: str) -> tuple[int | None, frozenset[int]]:
    """(window, the layers that use it).  Mistral windows every layer; Gemma 2 and gpt-oss every other one
    (from layer 0); Gemma 3 all but every ``sliding_window_pattern``-th; ``layer_types``, where a config
    has it, says it layer by layer and wins."""
    qwen = family in ("qwen2", *QWEN3)
    if qwen and not cfg.get("use_sliding_window", False):
        return None, frozenset()
    window = cfg.get("sliding_window")
    if window is None:
        return None, frozenset()
    if qwen:
        raise ConfigError(f"{name}: Qwen with use_sliding_window=true applies the window to some layers only; "
                          "llmlab.memory does not model that: set use_sliding_window to false.")
    window = _int_field(cfg, "sliding_window", name)
    types = cfg.get("layer_types")
    if types is not None:
        kinds = {"sliding_attention", "full_attention"}
        if not isinstance(types, list) or len(types) != layers or not set(types) <= kinds:
            raise ConfigError(f"{name}: layer_types should list 'sliding_attention' or 'full_attention' for each of "
                              f"the {layers} layers, got {types!r}.")
        return window, frozenset(i for i, t in enumerate(types) if t == "sliding_attention")
    if family in ("gemma2", "gpt_oss"):
        return window, frozenset(range(0, layers, 2))
    if family == "gemma3_text":
        pattern = _int_field(cfg, "sliding_window_pattern", name) if "sliding_window_pattern" in cfg else 6
        return window, frozenset(i for i in range(layers) if (i + 1) % pattern)
    return window, frozenset(range(layers))


def _quantization(cfg: dict, name: str) -> tuple[str | None, frozenset[str]]:
    q = cfg.get("quantization_config")
    if q is None:
        return None, frozenset()
    if not isinstance(q, dict) or not q.get("quant_method"):
        raise ConfigError(f"{name}: quantization_config should be an object with a 'quant_method'.")
    skip = q.get("modules_to_not_convert") or []
    return str(q["quant_method"]), frozenset(skip)


def _experts(cfg: dict, family: str, layers: int, name: str) -> tuple[int, int, int, frozenset[int]]:
    """(experts per MoE layer, experts per token, one expert's width, dense layers) of a config.

    Mixtral: every layer is MoE, each expert as wide as ``intermediate_size``.  Qwen3-MoE: experts of
    ``moe_intermediate_size``; a layer is MoE when (layer + 1) is a multiple of ``decoder_sparse_step``
    and it is not in ``mlp_only_layers`` (transformers' and vLLM's rule); the others are dense.  DeepSeek:
    ``n_routed_experts`` of ``moe_intermediate_size`` after ``first_k_dense_replace`` dense layers.
    """
    dense_deepseek = family in DEEPSEEK and cfg.get("n_routed_experts") is None
    if family not in ("mixtral", "qwen3_moe", "gpt_oss", "llama4_text", *DEEPSEEK) or dense_deepseek:
        return 0, 0, 0, frozenset()
    key = {"mixtral": "num_local_experts", "gpt_oss": "num_local_experts", "llama4_text": "num_local_experts",
           "qwen3_moe": "num_experts"}.get(family, "n_routed_experts")
    experts, per_token = _int_field(cfg, key, name), _int_field(cfg, "num_experts_per_tok", name)
    if per_token > experts:
        raise ConfigError(f"{name}: num_experts_per_tok {per_token} exceeds {key} {experts}.")
    if family in ("mixtral", "gpt_oss"):
        return experts, per_token, _int_field(cfg, "intermediate_size", name), frozenset()
    if family == "llama4_text":  # every interleave_moe_layer_step-th layer is MoE (moe_layers, where given, wins)
        step = _int_field(cfg, "interleave_moe_layer_step", name) if "interleave_moe_layer_step" in cfg else 1
        moe = cfg.get("moe_layers")
        moe = range(step - 1, layers, step) if moe is None else moe
        if not all(isinstance(i, int) and 0 <= i < layers for i in moe):
            raise ConfigError(f"{name}: moe_layers should list layer numbers below {layers}, got {moe!r}.")
        return experts, per_token, _int_field(cfg, "intermediate_size", name), frozenset(set(range(layers)) - set(moe))
    if family in DEEPSEEK:  # the first first_k_dense_replace layers are dense, then every moe_layer_freq-th is MoE
        first = cfg.get("first_k_dense_replace", 0)
        freq = _int_field(cfg, "moe_layer_freq", name) if "moe_layer_freq" in cfg else 1
        if not isinstance(first, int) or first < 0:
            raise ConfigError(f"{name}: first_k_dense_replace should be a whole number >= 0, got {first!r}.")
        dense = frozenset(i for i in range(layers) if i < first or i % freq)
        return experts, per_token, _int_field(cfg, "moe_intermediate_size", name), dense
    step = _int_field(cfg, "decoder_sparse_step", name) if "decoder_sparse_step" in cfg else 1
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and 0 <= i < layers for i in only):
        raise ConfigError(f"{name}: mlp_only_layers should be a list of layer numbers below {layers}, got {only!r}.")
    dense = frozenset(i for i in range(layers) if i in only or (i + 1) % step)
    return experts, per_token, _int_field(cfg, "moe_intermediate_size", name), dense


def _mla(cfg: dict, family: str, name: str) -> dict:
    """The latent-attention fields of a DeepSeek config (empty for other families); q_lora_rank may be null
    (DeepSeek-V2-Lite: queries projected directly)."""
    if family not in DEEPSEEK:
        return {}
    out = {k: _int_field(cfg, k, name) for k in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim")}
    out["q_lora_rank"] = 0 if cfg.get("q_lora_rank") is None else _int_field(cfg, "q_lora_rank", name)
    out["head_dim"] = _int_field(cfg, "qk_nope_head_dim", name) + out["qk_rope_head_dim"]
    return out


def _shared_experts(cfg: dict, family: str, name: str) -> int:
    """Experts every token runs: DeepSeek's n_shared_experts, Llama 4's one shared expert."""
    if family == "llama4_text":
        return 1
    if family not in DEEPSEEK or cfg.get("n_shared_experts") is None:
        return 0
    return _int_field(cfg, "n_shared_experts", name)


def _quant_block(cfg: dict, name: str) -> tuple[int, int] | None:
    q = cfg.get("quantization_config") or {}
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    if block is None:
        return None
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{name}: quantization_config.weight_block_size should be two positive integers, "
                          f"got {block!r}.")
    return tuple(block)


def _language_model(cfg: dict, name: str) -> tuple[dict, list[str]]:
    """A vision-language config's language model: its ``text_config``, with the top level's dtype and
    quantization where the text config has none.  The vision tower is not counted, and the report says so."""
    archs = cfg.get("architectures") or []
    if not (isinstance(archs, list) and archs and archs[0] in VISION_LANGUAGE):
        return cfg, []
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{name}: a {archs[0]} config keeps its language model in 'text_config', and this one has "
                          "none: check the file is the model's config.json.")
    inherited = {k: cfg[k] for k in ("torch_dtype", "dtype", "quantization_config") if k in cfg and k not in text}
    merged = {**text, **inherited, "architectures": [VISION_LANGUAGE[archs[0]]]}
    return merged, [f"the language model only: {archs[0]}'s vision tower (vision_config) is not counted"]


def _spec_from_config(cfg: dict, name: str, source: str) -> ModelSpec:
    cfg, applied = _language_model(cfg, name)
    family, arch = _family(cfg, name)
    hidden = _int_field(cfg, "hidden_size", name)
    heads = _int_field(cfg, "num_attention_heads", name)
    if family == "llama" and cfg.get("num_key_value_heads") is None:
        kv = heads
        applied.append(f"num_key_value_heads={heads} (LlamaConfig's default: multi-head attention)")
    else:
        kv = _int_field(cfg, "num_key_value_heads", name)
    if heads % kv:
        raise ConfigError(f"{name}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}; "
                          "grouped-query attention needs whole groups.")
    has_flag = family in ("llama", "gpt_oss", "llama4_text", *QWEN3, *GEMMA)
    attention_bias = _bool_field(cfg, "attention_bias", False, name, applied) if has_flag else False
    layers = _int_field(cfg, "num_hidden_layers", name)
    experts, per_token, width, dense = _experts(cfg, family, layers, name)
    ctx = cfg.get("max_position_embeddings")
    quant_method, not_quantized = _quantization(cfg, name)
    mla = _mla(cfg, family, name)
    window, sliding = _sliding_window(cfg, family, layers, name)
    if cfg.get("attention_chunk_size"):
        applied.append("attention_chunk_size: vLLM caches chunked local attention layers as full attention (it "
                       "turns its hybrid KV cache manager off for them by default)")
    head_dim = mla.pop("head_dim") if mla else _head_dim(cfg, hidden, heads, name, family, applied)
    if mla and cfg.get("attention_bias"):
        raise ConfigError(f"{name}: DeepSeek attention with attention_bias=true is not modelled by llmlab.memory "
                          "(no published checkpoint has it); check the config's attention_bias field.")
    return ModelSpec(
        name=name, family=family, architecture=arch,
        vocab_size=_int_field(cfg, "vocab_size", name), hidden_size=hidden,
        intermediate_size=_int_field(cfg, "intermediate_size_mlp" if family == "llama4_text" else "intermediate_size",
                                     name),
        shared_experts=_shared_experts(cfg, family, name),
        num_layers=layers, num_heads=heads, num_kv_heads=kv,
        head_dim=head_dim,
        tie_word_embeddings=_bool_field(cfg, "tie_word_embeddings", family in GEMMA, name, applied),
        qkv_bias=attention_bias or family == "qwen2", o_bias=attention_bias,
        mlp_bias=_bool_field(cfg, "mlp_bias", False, name, applied) if family == "llama" else False,
        num_experts=experts, experts_per_token=per_token, expert_width=width, dense_layers=dense,
        qk_norm=family in QWEN3 or family == "gemma3_text", expert_bias=family == "gpt_oss",
        attention_sinks=family == "gpt_oss", sandwich_norms=family in GEMMA,
        max_position_embeddings=None if ctx is None else _int_field(cfg, "max_position_embeddings", name),
        torch_dtype=_torch_dtype(cfg, name), sliding_window=window, sliding_layers=sliding,
        quant_method=quant_method, not_quantized=not_quantized, hf_id=HF_IDS.get(name), source=source,
        defaults_applied=tuple(applied), quant_block=_quant_block(cfg, name), **mla,
    )


def model_spec(model) -> ModelSpec:
    """Read and validate a model: a :class:`ModelSpec`, a shipped name, a config path/directory, or a dict."""
    if isinstance(model, ModelSpec):
        return model
    cfg, source = load_config(model)
    if isinstance(model, Mapping):
        name = str(cfg.get("_name_or_path") or "config")
    elif str(model) in shipped_models():
        name = str(model)
    else:
        name = Path(source).parent.name
    return _spec_from_config(cfg, name, source)
