"""Memory arithmetic for LLM serving, derived from a model's own ``config.json``.

Why: "how many GPUs does this model need?" has an exact answer for the weights and the KV cache, and
the published tables get it wrong often enough (rounded parameter counts, GB mixed with GiB, one KV
figure twice too large) that the course derives every number from the configuration instead.

Everything here is a pure function: a model is a path to a ``config.json`` (or its directory), a dict,
a shipped name (``llama3.1-8b`` ... ``llmlab-tiny``) or a :class:`ModelSpec`.  The layers are:

1. :func:`model_spec` reads and validates a config (a clear :class:`ConfigError` names any missing or
   odd field; transformers' documented defaults are applied *visibly*, in ``spec.defaults_applied``);
2. :func:`tensors` lists every weight tensor with its shape, so parameter counts, bytes per dtype and
   the share of each GPU under tensor/pipeline parallelism are sums over one list;
3. the KV cache: bytes per token, per request, and vLLM's block arithmetic (:func:`kv_capacity`), which
   reproduces to the token the "KV cache size" and "Maximum concurrency" lines that vLLM logs;
4. GPUs: :func:`gpus_needed` (how many cards' worth of memory) and :func:`plan` (the smallest valid
   TP x PP layout and its ``vllm serve`` command line).

Units: bytes are exact integers; ``GB`` is 10**9 bytes (datasheets, published tables) and ``GiB`` is
2**30 bytes (what vLLM and PyTorch print).  The difference is 7 %, larger than many of the margins.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

GB = 10**9
GiB = 2**30

MODELS_DIR = Path(__file__).parent / "models"
CONFIGS_DIR = MODELS_DIR / "configs"
TINY_NAME = "llmlab-tiny"

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
}

# vLLM's default KV block size (tokens per block) per platform: 16 on CUDA (CacheConfig's default),
# 128 on its CPU backend (vllm/platforms/cpu.py sets it when the user gives none).
GPU_BLOCK_SIZE = 16
CPU_BLOCK_SIZE = 128

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
}


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
    num_experts: int = 0            # 0: a dense MLP; otherwise num_local_experts of a mixture of experts
    experts_per_token: int = 0
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
            raise ConfigError(f"{name}: architecture {arch!r} is not supported by llmlab.memory (supported: "
                              f"{', '.join(ARCHITECTURES)}). Its parameter layout differs, so llmlab does not guess.")
        return ARCHITECTURES[arch], arch
    model_type = cfg.get("model_type")
    by_type = {family: arch for arch, family in ARCHITECTURES.items()}
    if model_type in by_type:
        return model_type, by_type[model_type]
    raise ConfigError(f"{name}: the config names neither a supported 'architectures' entry nor a supported "
                      f"'model_type' (got {model_type!r}); supported: {', '.join(ARCHITECTURES)}.")


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


def _head_dim(cfg: dict, hidden: int, heads: int, name: str) -> int:
    if cfg.get("head_dim") is not None:  # explicit (e.g. Mistral Nemo: 128 while 5120 / 32 = 160)
        return _int_field(cfg, "head_dim", name)
    if hidden % heads:
        raise ConfigError(f"{name}: hidden_size {hidden} is not divisible by num_attention_heads {heads} and the "
                          "config gives no head_dim: add the model's head_dim.")
    return hidden // heads


def _sliding_window(cfg: dict, family: str, name: str) -> int | None:
    if family == "qwen2" and not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if family == "qwen2":
        raise ConfigError(f"{name}: Qwen2 with use_sliding_window=true applies the window to some layers only; "
                          "llmlab.memory does not model that.")
    return _int_field(cfg, "sliding_window", name)


def _quantization(cfg: dict, name: str) -> tuple[str | None, frozenset[str]]:
    q = cfg.get("quantization_config")
    if q is None:
        return None, frozenset()
    if not isinstance(q, dict) or not q.get("quant_method"):
        raise ConfigError(f"{name}: quantization_config should be an object with a 'quant_method'.")
    skip = q.get("modules_to_not_convert") or []
    return str(q["quant_method"]), frozenset(skip)


def _spec_from_config(cfg: dict, name: str, source: str) -> ModelSpec:
    family, arch = _family(cfg, name)
    applied: list[str] = []
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
    attention_bias = _bool_field(cfg, "attention_bias", False, name, applied) if family == "llama" else False
    experts = per_token = 0
    if family == "mixtral":
        experts = _int_field(cfg, "num_local_experts", name)
        per_token = _int_field(cfg, "num_experts_per_tok", name)
        if per_token > experts:
            raise ConfigError(f"{name}: num_experts_per_tok {per_token} exceeds num_local_experts {experts}.")
    ctx = cfg.get("max_position_embeddings")
    quant_method, not_quantized = _quantization(cfg, name)
    return ModelSpec(
        name=name, family=family, architecture=arch,
        vocab_size=_int_field(cfg, "vocab_size", name), hidden_size=hidden,
        intermediate_size=_int_field(cfg, "intermediate_size", name),
        num_layers=_int_field(cfg, "num_hidden_layers", name), num_heads=heads, num_kv_heads=kv,
        head_dim=_head_dim(cfg, hidden, heads, name),
        tie_word_embeddings=_bool_field(cfg, "tie_word_embeddings", False, name, applied),
        qkv_bias=attention_bias or family == "qwen2", o_bias=attention_bias,
        mlp_bias=_bool_field(cfg, "mlp_bias", False, name, applied) if family == "llama" else False,
        num_experts=experts, experts_per_token=per_token,
        max_position_embeddings=None if ctx is None else _int_field(cfg, "max_position_embeddings", name),
        torch_dtype=_torch_dtype(cfg, name), sliding_window=_sliding_window(cfg, family, name),
        quant_method=quant_method, not_quantized=not_quantized, hf_id=HF_IDS.get(name), source=source,
        defaults_applied=tuple(applied),
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


# --------------------------------------------------------------------------------------------------
# Weights: every tensor, then sums
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tensor:
    """One weight tensor, shaped (out, in) like PyTorch's Linear, or (n,) for a vector.

    ``split`` says how tensor parallelism shards it, as vLLM does: ``col`` splits the outputs (q, gate,
    up, expert w1/w3), ``row`` the inputs (o, down, w2), ``kv`` splits by KV head and replicates when
    TP exceeds the KV heads, ``vocab`` splits the (64-padded) vocabulary, ``none`` replicates.
    """

    name: str
    shape: tuple[int, ...]
    split: str
    group: str          # embedding, attention, mlp, experts, router, norm, lm_head
    layer: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def is_matrix(self) -> bool:
        return len(self.shape) == 2 and self.group not in ("embedding", "lm_head", "router")


def _attention(s: ModelSpec, p: str, i: int) -> list[Tensor]:
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    out = [Tensor(f"{p}.q_proj.weight", (q, s.hidden_size), "col", "attention", i),
           Tensor(f"{p}.k_proj.weight", (kv, s.hidden_size), "kv", "attention", i),
           Tensor(f"{p}.v_proj.weight", (kv, s.hidden_size), "kv", "attention", i),
           Tensor(f"{p}.o_proj.weight", (s.hidden_size, q), "row", "attention", i)]
    if s.qkv_bias:
        out += [Tensor(f"{p}.q_proj.bias", (q,), "col", "attention", i),
                Tensor(f"{p}.k_proj.bias", (kv,), "kv", "attention", i),
                Tensor(f"{p}.v_proj.bias", (kv,), "kv", "attention", i)]
    if s.o_bias:
        out.append(Tensor(f"{p}.o_proj.bias", (s.hidden_size,), "none", "attention", i))
    return out


def _mlp(s: ModelSpec, p: str, i: int) -> list[Tensor]:
    h, f = s.hidden_size, s.intermediate_size
    if s.num_experts:  # Mixtral: a router, then experts w1 (gate), w3 (up), w2 (down), no biases
        out = [Tensor(f"{p}.gate.weight", (s.num_experts, h), "none", "router", i)]
        for e in range(s.num_experts):
            x = f"{p}.experts.{e}"
            out += [Tensor(f"{x}.w1.weight", (f, h), "col", "experts", i),
                    Tensor(f"{x}.w3.weight", (f, h), "col", "experts", i),
                    Tensor(f"{x}.w2.weight", (h, f), "row", "experts", i)]
        return out
    out = [Tensor(f"{p}.gate_proj.weight", (f, h), "col", "mlp", i),
           Tensor(f"{p}.up_proj.weight", (f, h), "col", "mlp", i),
           Tensor(f"{p}.down_proj.weight", (h, f), "row", "mlp", i)]
    if s.mlp_bias:
        out += [Tensor(f"{p}.gate_proj.bias", (f,), "col", "mlp", i),
                Tensor(f"{p}.up_proj.bias", (f,), "col", "mlp", i),
                Tensor(f"{p}.down_proj.bias", (h,), "none", "mlp", i)]
    return out


@functools.cache
def _tensors(s: ModelSpec) -> tuple[Tensor, ...]:
    out = [Tensor("model.embed_tokens.weight", (s.vocab_size, s.hidden_size), "vocab", "embedding")]
    mlp = "block_sparse_moe" if s.num_experts else "mlp"
    for i in range(s.num_layers):
        p = f"model.layers.{i}"
        out.append(Tensor(f"{p}.input_layernorm.weight", (s.hidden_size,), "none", "norm", i))
        out += _attention(s, f"{p}.self_attn", i)
        out.append(Tensor(f"{p}.post_attention_layernorm.weight", (s.hidden_size,), "none", "norm", i))
        out += _mlp(s, f"{p}.{mlp}", i)
    out.append(Tensor("model.norm.weight", (s.hidden_size,), "none", "norm"))
    if not s.tie_word_embeddings:
        out.append(Tensor("lm_head.weight", (s.vocab_size, s.hidden_size), "vocab", "lm_head"))
    return tuple(out)


def tensors(model) -> tuple[Tensor, ...]:
    """Every weight tensor of the model, in checkpoint order.  A tied LM head is the embedding: not listed."""
    return _tensors(model_spec(model))


def param_count(model) -> int:
    """Total parameters (a tied LM head counted once, as Hugging Face counts them)."""
    return sum(t.numel for t in tensors(model))


def param_breakdown(model) -> dict[str, int]:
    """Parameters per group (embedding, attention, mlp or experts + router, norm, lm_head)."""
    out: dict[str, int] = {}
    for t in tensors(model):
        out[t.group] = out.get(t.group, 0) + t.numel
    return out


def active_params(model) -> int:
    """Parameters one token touches: a mixture of experts only runs experts_per_token of its experts."""
    s = model_spec(model)
    total = param_count(s)
    if not s.num_experts:
        return total
    experts = param_breakdown(s)["experts"]
    return total - experts + experts * s.experts_per_token // s.num_experts


def _checkpoint_bits(s: ModelSpec, t: Tensor, numel: int, rows: int) -> int:
    """Bits a (shard of a) tensor takes as stored in the checkpoint, fp8 scales included."""
    base = DTYPE_BITS[s.require_dtype()]
    if s.quant_method is None or not t.is_matrix or t.name.endswith(".bias"):
        return numel * base
    if s.quant_method != "fbgemm_fp8":
        raise ConfigError(f"{s.name}: quantization method {s.quant_method!r} is not modelled by llmlab.memory; "
                          "pass dtype='int4', 'int8' or 'fp8' for an estimate that counts every weight alike.")
    if t.module in s.not_quantized:
        return numel * base
    return numel * 8 + rows * 32  # one fp8 byte per weight + one float32 scale per output channel


def _bits(s: ModelSpec, t: Tensor, dtype: str | None, numel: int, rows: int) -> int:
    if dtype is None:
        return _checkpoint_bits(s, t, numel, rows)
    return numel * DTYPE_BITS[normalize_dtype(dtype)]


def weight_bytes(model, dtype: str | None = None) -> int:
    """Bytes of all weights.

    ``dtype=None``: as the checkpoint stores them (its torch_dtype; for an FP8 checkpoint, the FP8
    matrices with their scales and the layers it keeps in bf16).  A dtype name: every parameter in that
    dtype, which is what published tables do; real fp8/int8/int4 deployments keep embeddings and norms
    in 16 bits and add scales, so they need a little more.
    """
    s = model_spec(model)
    bits = sum(_bits(s, t, dtype, t.numel, t.shape[0]) for t in tensors(s))
    return -(-bits // 8)


# --------------------------------------------------------------------------------------------------
# Parallelism: what each GPU holds
# --------------------------------------------------------------------------------------------------

def check_tp(model, tp: int) -> None:
    """Raise if vLLM could not shard this model ``tp`` ways (heads, KV heads, MLP width must divide)."""
    s = model_spec(model)
    if tp < 1:
        raise PlanError(f"tensor parallel size must be >= 1, got {tp}")
    if s.num_heads % tp:
        raise PlanError(f"{s.name}: {s.num_heads} attention heads do not divide into {tp} tensor-parallel shards.")
    if s.num_kv_heads % tp and tp % s.num_kv_heads:
        raise PlanError(f"{s.name}: {s.num_kv_heads} KV heads can neither be split nor evenly replicated over {tp} "
                        "GPUs; use a TP size that divides them or that they divide.")
    if s.intermediate_size % tp:
        raise PlanError(f"{s.name}: MLP width {s.intermediate_size} does not divide by TP={tp}.")


def valid_tp_sizes(model, max_tp: int) -> list[int]:
    """TP sizes up to ``max_tp`` that vLLM accepts for this model."""
    out = []
    for tp in range(1, max_tp + 1):
        try:
            check_tp(model, tp)
        except PlanError:
            continue
        out.append(tp)
    return out


def pp_partition(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage, split as vLLM does (``get_pp_indices``): evenly, and any remainder one
    layer each to the stages just before the last (the last stage also carries the final norm and head)."""
    if not 1 <= pp <= num_layers:
        raise PlanError(f"pipeline parallel size must be between 1 and the {num_layers} layers, got {pp}")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return parts


def _stage_of(t: Tensor, bounds: list[tuple[int, int]]) -> list[int]:
    last = len(bounds) - 1
    if t.group == "embedding":
        return [0]
    if t.layer is None:  # final norm, LM head
        return [last]
    return [k for k, (lo, hi) in enumerate(bounds) if lo <= t.layer < hi]


def _shard(s: ModelSpec, t: Tensor, tp: int) -> tuple[int, int]:
    """(elements, output rows) of one GPU's shard of ``t`` at tensor parallel size ``tp``."""
    rows = t.shape[0]
    if t.split == "col":
        rows = rows // tp
    elif t.split == "kv":
        rows = max(1, s.num_kv_heads // tp) * s.head_dim
    elif t.split == "vocab":
        rows = -(-(-(-rows // 64) * 64) // tp)  # vLLM pads the vocabulary to a multiple of 64, then splits it
    elif t.split == "row":
        return rows * t.shape[1] // tp, rows
    return rows * math.prod(t.shape[1:]), rows


def weight_bytes_per_gpu(model, dtype: str | None = None, tp: int = 1, pp: int = 1) -> list[int]:
    """Bytes of weights one GPU of each pipeline stage holds (norms and routers are replicated).

    With tied embeddings and PP > 1 the last stage holds its own copy of the LM head, as vLLM does.
    """
    s = model_spec(model)
    check_tp(s, tp)
    return list(_weight_bytes_per_gpu(s, None if dtype is None else normalize_dtype(dtype), tp, pp))


@functools.cache
def _weight_bytes_per_gpu(s: ModelSpec, dtype: str | None, tp: int, pp: int) -> tuple[int, ...]:
    parts = pp_partition(s.num_layers, pp)
    bounds = [(sum(parts[:k]), sum(parts[:k + 1])) for k in range(pp)]
    bits = [0] * pp
    for t in tensors(s):
        numel, rows = _shard(s, t, tp)
        for k in _stage_of(t, bounds):
            bits[k] += _bits(s, t, dtype, numel, rows)
    if s.tie_word_embeddings and pp > 1:
        head = tensors(s)[0]
        numel, rows = _shard(s, head, tp)
        bits[-1] += _bits(s, head, dtype, numel, rows)
    return tuple(-(-b // 8) for b in bits)


# --------------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------------

def kv_bytes_per_token(model, kv_dtype: str = "auto", dtype: str | None = None, tp: int = 1,
                       layers: int | None = None) -> int:
    """Bytes of K and V one token leaves in the cache: layers x 2 x kv_heads x head_dim x bytes.

    ``tp`` and ``layers`` give one GPU's share: its KV heads (at least one: vLLM replicates KV heads
    when TP exceeds them) and its pipeline stage's layers.
    """
    s = model_spec(model)
    heads = s.num_kv_heads if tp == 1 else max(1, s.num_kv_heads // tp)
    n = s.num_layers if layers is None else layers
    return n * 2 * heads * s.head_dim * kv_dtype_bytes(s, kv_dtype, dtype)


def kv_tokens_held(model, tokens: int) -> int:
    """Tokens of one request that stay in the cache: all of them, except for a sliding-window model
    (Mistral 7B v0.1: 4,096), which keeps about the window (vLLM reserves one scheduling chunk more)."""
    s = model_spec(model)
    return tokens if s.sliding_window is None else min(tokens, s.sliding_window)


def kv_cache_bytes(model, tokens: int, concurrency: int = 1, kv_dtype: str = "auto",
                   dtype: str | None = None) -> int:
    """Bytes of KV cache for ``concurrency`` requests of ``tokens`` tokens each (prompt + output)."""
    if tokens < 0 or concurrency < 0:
        raise ValueError(f"tokens and concurrency must be >= 0, got {tokens} and {concurrency}")
    return kv_tokens_held(model, tokens) * concurrency * kv_bytes_per_token(model, kv_dtype, dtype)


@dataclass(frozen=True)
class KVCapacity:
    """What vLLM makes of a KV budget: whole blocks, the tokens it reports, and the concurrency."""

    budget_bytes: int
    bytes_per_token: int
    block_size: int
    blocks: int
    max_model_len: int | None
    tokens: int
    max_concurrency: float | None

    def log_line(self, device: str = "GPU") -> str:
        """The line vLLM logs at start-up, e.g. "CPU KV cache size: 524,288 tokens, Maximum concurrency ..."."""
        if self.max_model_len is None:
            raise ValueError("the log line needs max_model_len (the context length vLLM serves)")
        return (f"{device} KV cache size: {self.tokens:,} tokens, Maximum concurrency for "
                f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x")


def kv_blocks(budget_bytes: int, bytes_per_token: int, block_size: int = GPU_BLOCK_SIZE) -> int:
    """Whole blocks of ``block_size`` tokens that fit in the budget: vLLM never allocates a partial block."""
    if bytes_per_token <= 0 or block_size <= 0:
        raise ValueError("bytes_per_token and block_size must be positive")
    return max(0, int(budget_bytes)) // (bytes_per_token * block_size)


def kv_capacity(budget_bytes: int, bytes_per_token: int, block_size: int = GPU_BLOCK_SIZE,
                max_model_len: int | None = None, blocks: int | None = None) -> KVCapacity:
    """vLLM's KV arithmetic (``vllm/v1/core/kv_cache_utils.py``), step by step.

    blocks = budget // (block_size x bytes per token); one request of max_model_len tokens needs
    ceil(max_model_len / block_size) blocks; concurrency = blocks / that (a float); and the "KV cache
    size" vLLM reports is int(concurrency x max_model_len) -- equal to blocks x block_size only when
    max_model_len is a multiple of the block size.  The float steps are kept as vLLM does them, so the
    result matches its log to the token.  ``bytes_per_token`` is one GPU's (see :func:`kv_bytes_per_token`);
    ``blocks`` overrides the computed count (vLLM takes the smallest over all GPUs).
    """
    n = kv_blocks(budget_bytes, bytes_per_token, block_size) if blocks is None else blocks
    if max_model_len is None:
        return KVCapacity(int(budget_bytes), bytes_per_token, block_size, n, None, n * block_size, None)
    per_request = -(-max_model_len // block_size)
    concurrency = n / per_request
    return KVCapacity(int(budget_bytes), bytes_per_token, block_size, n, max_model_len,
                      int(concurrency * max_model_len), concurrency)


def kv_tokens(budget_bytes: int, bytes_per_token: int, block_size: int = GPU_BLOCK_SIZE,
              max_model_len: int | None = None) -> int:
    """Tokens of KV cache vLLM reports for a budget (see :func:`kv_capacity`)."""
    return kv_capacity(budget_bytes, bytes_per_token, block_size, max_model_len).tokens


def max_concurrency(budget_bytes: int, bytes_per_token: int, tokens_per_request: int,
                    block_size: int = GPU_BLOCK_SIZE) -> float:
    """vLLM's "Maximum concurrency for N tokens per request": full-length requests the cache holds at once."""
    return kv_capacity(budget_bytes, bytes_per_token, block_size, tokens_per_request).max_concurrency


def kv_budget(gpu_bytes: int, weights: int, activation: int, non_torch: int = 0, cuda_graphs: int = 0,
              utilization: float = DEFAULT_UTILIZATION) -> int:
    """The KV budget vLLM computes on one GPU: utilization x total memory, minus the weights, the profiled
    peak activation, non-torch memory and (vLLM 0.32 by default; not 0.26) its CUDA-graph estimate.
    With the figures from its start-up log the result is exact up to their rounding."""
    return int(utilization * gpu_bytes) - weights - activation - non_torch - cuda_graphs


KV_LOG = re.compile(r"(?P<device>\w+(?: \+ host)?) KV cache size: (?P<tokens>[\d,]+) tokens, Maximum concurrency "
                    r"for (?P<len>[\d,]+) tokens per request: (?P<conc>[\d.]+)x")


def parse_kv_log(text: str) -> dict:
    """The last "KV cache size ... Maximum concurrency ..." line in a vLLM log, as numbers."""
    found = list(KV_LOG.finditer(text))
    if not found:
        raise ValueError("No 'KV cache size: N tokens, Maximum concurrency for M tokens per request: Cx' line in "
                         "this log: the engine has not finished starting, or this is not a vLLM server log.")
    m = found[-1]
    return {"device": m["device"], "tokens": int(m["tokens"].replace(",", "")),
            "max_model_len": int(m["len"].replace(",", "")), "max_concurrency": float(m["conc"]),
            "line": m.group(0)}


def embedded_kv_capacity(kv_cache_gib: float = 1, model=TINY_NAME, max_model_len: int | None = None,
                         dtype: str | None = None) -> KVCapacity:
    """What llmlab's embedded CPU server will log for a KV space of ``kv_cache_gib`` GiB.

    vLLM's CPU backend reads ``VLLM_CPU_KVCACHE_SPACE`` with ``int()``, so only whole GiB work; it
    uses blocks of 128 tokens; the embedded server serves the checkpoint's dtype (float32).
    """
    if float(kv_cache_gib) != int(kv_cache_gib) or kv_cache_gib < 1:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be a whole number of GiB (vLLM parses it with int()), "
                         f"got {kv_cache_gib}: use 1, 2, ...")
    s = model_spec(model)
    length = max_model_len or s.require_context()
    return kv_capacity(int(kv_cache_gib) * GiB, kv_bytes_per_token(s, "auto", dtype), CPU_BLOCK_SIZE, length)


# --------------------------------------------------------------------------------------------------
# GPUs
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPU:
    """A GPU model: its datasheet label, and the total memory CUDA/ROCm report (what vLLM's
    gpu_memory_utilization multiplies)."""

    name: str
    label: str
    memory_bytes: int
    note: str = ""

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB


def _gib(x: float) -> int:
    return round(x * GiB)


GPUS = {
    "A100-40": GPU("A100-40", "40 GB", _gib(39.59), "A100-SXM4-40GB as PyTorch reports it"),
    "A100-80": GPU("A100-80", "80 GB", _gib(79.15), "A100-SXM4-80GB as PyTorch reports it"),
    "H100-80": GPU("H100-80", "80 GB", _gib(79.18), "H100 80GB HBM3, measured in vLLM's log"),
    "H200-141": GPU("H200-141", "141 GB", _gib(139.81), "H200 as PyTorch reports it"),
    "MI300X-192": GPU("MI300X-192", "192 GB", _gib(191.98), "MI300X as PyTorch (ROCm) reports it"),
}
_GPU_ALIASES = {"A100": "A100-80", "H100": "H100-80", "H200": "H200-141", "MI300X": "MI300X-192"}


def gpu(name) -> GPU:
    """A named GPU (``H100-80``, ``A100-40``, ...; case and a trailing "GB" do not matter), a
    :class:`GPU`, or a custom size: ``custom:48`` or the number 48 (GiB as the driver reports it)."""
    if isinstance(name, GPU):
        return name
    if isinstance(name, int | float) and not isinstance(name, bool):
        if name <= 0:
            raise UnknownName(f"A custom GPU needs a positive size in GiB, got {name}.")
        return GPU(f"custom-{name:g}", f"{name:g} GiB", _gib(name), "custom size")
    key = str(name).strip().upper().replace("_", "-").removesuffix("GB")
    if key.startswith("CUSTOM:"):
        try:
            return gpu(float(key.split(":", 1)[1]))
        except ValueError:
            raise UnknownName(f"{name!r}: write a custom GPU as custom:<GiB>, e.g. custom:48.") from None
    key = _GPU_ALIASES.get(key, key)
    if key not in GPUS and re.fullmatch(r"\d+(\.\d+)?", key):
        return gpu(float(key))
    if key not in GPUS:
        raise UnknownName(f"Unknown GPU {name!r}. Known: {', '.join(GPUS)}; or custom:<GiB> (e.g. custom:48).")
    return GPUS[key]


def usable_bytes(gpu_name, utilization: float = DEFAULT_UTILIZATION,
                 overhead_gib: float = DEFAULT_OVERHEAD_GIB) -> int:
    """Memory per GPU left for weights and KV cache: utilization x total, minus the activation allowance."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    return int(utilization * gpu(gpu_name).memory_bytes) - _gib(overhead_gib)


def _usable_or_fail(gpu_name, utilization: float, overhead_gib: float) -> int:
    usable = usable_bytes(gpu_name, utilization, overhead_gib)
    if usable <= 0:
        raise PlanError(f"{gpu(gpu_name).name} at utilization {utilization} leaves nothing after the "
                        f"{overhead_gib} GiB activation allowance: use a larger GPU or a smaller allowance.")
    return usable


@dataclass(frozen=True)
class GPUCount:
    """How many GPUs' worth of usable memory a model needs (layout constraints not applied)."""

    weights: float            # fractional GPUs for the weights alone
    total: float              # ... for weights + KV cache
    weights_whole: int
    total_whole: int
    usable_bytes_per_gpu: int


def gpus_needed(model, dtype: str | None = None, kv_dtype: str = "auto", tokens: int = 0, concurrency: int = 1,
                gpu_name="H100-80", utilization: float = DEFAULT_UTILIZATION,
                overhead_gib: float = DEFAULT_OVERHEAD_GIB) -> GPUCount:
    """Memory needed divided by what one GPU offers vLLM, rounded up.  A lower bound: a real layout
    must also divide the heads (see :func:`plan`), which often rounds it up further."""
    usable = _usable_or_fail(gpu_name, utilization, overhead_gib)
    w = weight_bytes(model, dtype)
    t = w + kv_cache_bytes(model, tokens, concurrency, kv_dtype, dtype)
    return GPUCount(w / usable, t / usable, math.ceil(w / usable), max(1, math.ceil(t / usable)), usable)


# --------------------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------------------

@dataclass
class Plan:
    """A layout that fits: TP within a node, one pipeline stage per node, and what it leaves for KV."""

    model: str
    dtype: str
    kv_dtype: str
    gpu: str
    gpus_per_node: int
    tp: int
    pp: int
    nodes: int
    gpus: int
    context: int
    concurrency: int
    utilization: float
    weight_bytes_per_gpu: int      # the fullest GPU's share
    kv_budget_bytes_per_gpu: int   # the emptiest GPU's KV budget
    kv_bytes_per_token_per_gpu: int
    kv_blocks: int
    kv_tokens: int                 # what vLLM would log as "KV cache size"
    max_concurrency: float         # at `context` tokens per request
    command: str
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _evaluate(s: ModelSpec, dtype, kv_dtype, tp, pp, usable, context, block_size):
    """(weights, KV budgets, KV bytes per token) per stage of a TP x PP layout, its KV blocks (the smallest
    over the stages, as vLLM takes) and the concurrency at ``context``; None if the weights do not fit."""
    weights = weight_bytes_per_gpu(s, dtype, tp, pp)
    budgets = [usable - w for w in weights]
    if min(budgets) <= 0:
        return None
    per_token = [kv_bytes_per_token(s, kv_dtype, dtype, tp, n) for n in pp_partition(s.num_layers, pp)]
    blocks = min(kv_blocks(b, p, block_size) for b, p in zip(budgets, per_token, strict=True))
    held = kv_tokens_held(s, context)  # a sliding-window model needs blocks for its window only
    concurrency = blocks / -(-held // block_size)
    return weights, budgets, per_token, blocks, concurrency


def plan(model, dtype: str | None = None, kv_dtype: str = "auto", gpu_name="H100-80", gpus_per_node: int = 8,
         context: int | None = None, concurrency: int = 1, utilization: float = DEFAULT_UTILIZATION,
         overhead_gib: float = DEFAULT_OVERHEAD_GIB, max_nodes: int = 64,
         block_size: int = GPU_BLOCK_SIZE) -> Plan:
    """The smallest valid layout that holds the weights and ``concurrency`` requests of ``context`` tokens.

    Tensor parallelism stays inside a node (it all-reduces twice per layer: it needs NVLink), and
    pipeline parallelism spans nodes, one stage per node (it only passes activations between stages).
    "Smallest" means fewest nodes first, then fewest GPUs per node.  vLLM would also accept PP inside a
    node, which sometimes needs fewer GPUs in all (405B in bf16: TP=4 x PP=3 = 12 H100s for one 128k
    request); this planner keeps stages on node boundaries, as clusters allocate whole nodes.
    """
    s = model_spec(model)
    context = context or s.require_context()
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    usable = _usable_or_fail(gpu_name, utilization, overhead_gib)
    tps = valid_tp_sizes(s, gpus_per_node)
    candidates = sorted(((tp, pp) for pp in range(1, min(max_nodes, s.num_layers) + 1) for tp in tps),
                        key=lambda c: (c[1], c[0]))
    for tp, pp in candidates:
        found = _evaluate(s, dtype, kv_dtype, tp, pp, usable, context, block_size)
        if found is None or found[4] < concurrency:
            continue
        weights, budgets, per_token, blocks, fits = found
        cmd, notes = serve_command(s, tp=tp, pp=pp, max_model_len=context, dtype=dtype, kv_dtype=kv_dtype,
                                   gpu_memory_utilization=utilization)
        if s.sliding_window and context > s.sliding_window:
            notes.append(f"sliding window of {s.sliding_window} tokens: concurrency is approximate "
                         "(vLLM reserves one scheduling chunk more per request)")
        return Plan(s.name, dtype or "checkpoint", kv_dtype, gpu(gpu_name).name, gpus_per_node, tp, pp, pp,
                    tp * pp, context, concurrency, utilization, max(weights), min(budgets), max(per_token),
                    blocks, int(fits * context), fits, cmd, notes)
    raise PlanError(f"{s.name} does not fit {concurrency} request(s) of {context:,} tokens on up to {max_nodes} "
                    f"nodes of {gpus_per_node} x {gpu(gpu_name).name}: use a smaller dtype or context, or more "
                    "GPUs per node.")


def serve_command(model, tp: int = 1, pp: int = 1, max_model_len: int | None = None, dtype: str | None = None,
                  kv_dtype: str = "auto", gpu_memory_utilization: float = DEFAULT_UTILIZATION,
                  model_id: str | None = None) -> tuple[str, list[str]]:
    """The ``vllm serve`` line for a layout, and notes on what it assumes.  Only flags that differ from
    vLLM's defaults are written, except the parallel sizes, context and utilization, which are the plan."""
    s = model_spec(model)
    notes: list[str] = []
    local = str(Path(s.source).parent) if s.source.endswith(".json") else s.name
    args = ["vllm", "serve", model_id or s.hf_id or local]
    if dtype is None:
        if s.require_dtype() == "float32":
            args += ["--dtype", "float32"]  # vLLM's "auto" would downcast a float32 checkpoint to bfloat16
    else:
        d = normalize_dtype(dtype)
        if d in FLOAT_DTYPES:
            args += ["--dtype", d]
        elif d == "fp8" and s.quant_method is None:
            args += ["--quantization", "fp8"]
            notes.append("--quantization fp8 quantizes the linear layers at load time; embeddings and norms "
                         "stay 16-bit, so memory is a little above the all-fp8 estimate")
        elif d in ("int8", "int4"):
            notes.append(f"{d} needs a pre-quantized checkpoint (GPTQ, AWQ, compressed-tensors): serve that "
                         "repository; vLLM reads its quantization from its config.json")
    kv = normalize_kv_dtype(kv_dtype)
    if kv not in ("auto", serve_dtype(s, dtype)):
        if kv == "float32":
            raise PlanError("vLLM stores a float32 KV cache only when it computes in float32: use dtype='float32' "
                            "with kv_dtype='auto'.")
        args += ["--kv-cache-dtype", kv]
    args += ["--tensor-parallel-size", str(tp)]
    if pp > 1:
        args += ["--pipeline-parallel-size", str(pp), "--distributed-executor-backend", "ray"]
        notes.append("PP > 1 spans nodes: start a Ray cluster over them first (the SLURM launcher does)")
    if max_model_len:
        args += ["--max-model-len", str(max_model_len)]
    args += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    return " ".join(args), notes


# --------------------------------------------------------------------------------------------------
# One report (the CLI's --json, and the notebook's calculator)
# --------------------------------------------------------------------------------------------------

def memory_report(model, dtype: str | None = None, kv_dtype: str = "auto", tokens: int | None = None,
                  concurrency: int = 1, gpu_name="H100-80", gpus_per_node: int = 8,
                  utilization: float = DEFAULT_UTILIZATION, overhead_gib: float = DEFAULT_OVERHEAD_GIB) -> dict:
    """Everything about one model on one GPU type, as plain numbers.  ``tokens`` defaults to the model's
    full context (max_position_embeddings).  ``plan`` is None (and ``plan_error`` says why) if nothing fits."""
    s = model_spec(model)
    tokens = s.require_context() if tokens is None else tokens
    count = gpus_needed(s, dtype, kv_dtype, tokens, concurrency, gpu_name, utilization, overhead_gib)
    report = {
        "model": s.name, "architecture": s.architecture, "source": s.source,
        "params": param_count(s), "active_params": active_params(s),
        "dtype": dtype and normalize_dtype(dtype) or f"checkpoint ({s.torch_dtype})",
        "weight_bytes": weight_bytes(s, dtype),
        "kv_dtype": kv_dtype, "kv_bytes_per_token": kv_bytes_per_token(s, kv_dtype, dtype),
        "tokens": tokens, "concurrency": concurrency,
        "kv_cache_bytes": kv_cache_bytes(s, tokens, concurrency, kv_dtype, dtype),
        "gpu": gpu(gpu_name).name, "gpu_memory_bytes": gpu(gpu_name).memory_bytes,
        "gpu_memory_utilization": utilization, "overhead_gib": overhead_gib,
        "usable_bytes_per_gpu": count.usable_bytes_per_gpu,
        "gpus_needed_weights": count.weights_whole, "gpus_needed": count.total_whole,
        "gpus_needed_exact": round(count.total, 3),
        "sliding_window": s.sliding_window, "defaults_applied": list(s.defaults_applied),
        "plan": None, "plan_error": None,
    }
    try:
        report["plan"] = plan(s, dtype, kv_dtype, gpu_name, gpus_per_node, tokens, concurrency, utilization,
                              overhead_gib).as_dict() if tokens else None
    except PlanError as e:
        report["plan_error"] = str(e)
    return report
