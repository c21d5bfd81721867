"""Weights: every tensor of a model, its parameters and bytes, and each GPU's share under TP and PP.

Part of ``llmlab.memory`` (its ``__init__`` says how the parts fit); read them in the order model, weights,
kv, planner.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from llmlab.memory.model import DTYPE_BITS, ConfigError, ModelSpec, PlanError, model_spec, normalize_dtype

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


def _latent_attention(s: ModelSpec, p: str, i: int) -> list[Tensor]:
    """DeepSeek's multi-head latent attention, as vLLM shards it: the down-projections (into the query and
    KV latents) are replicated on every GPU, the up-projections split by head, o_proj by its inputs."""
    h, q = s.hidden_size, s.num_heads * s.head_dim
    if s.q_lora_rank:
        out = [Tensor(f"{p}.q_a_proj.weight", (s.q_lora_rank, h), "none", "attention", i),
               Tensor(f"{p}.q_a_layernorm.weight", (s.q_lora_rank,), "none", "norm", i),
               Tensor(f"{p}.q_b_proj.weight", (q, s.q_lora_rank), "col", "attention", i)]
    else:
        out = [Tensor(f"{p}.q_proj.weight", (q, h), "col", "attention", i)]
    nope = s.head_dim - s.qk_rope_head_dim
    return out + [
        Tensor(f"{p}.kv_a_proj_with_mqa.weight", (s.kv_lora_rank + s.qk_rope_head_dim, h), "none", "attention", i),
        Tensor(f"{p}.kv_a_layernorm.weight", (s.kv_lora_rank,), "none", "norm", i),
        Tensor(f"{p}.kv_b_proj.weight", (s.num_heads * (nope + s.v_head_dim), s.kv_lora_rank), "col", "attention", i),
        Tensor(f"{p}.o_proj.weight", (h, s.num_heads * s.v_head_dim), "row", "attention", i)]


def _attention(s: ModelSpec, p: str, i: int) -> list[Tensor]:
    if s.is_mla:
        return _latent_attention(s, p, i)
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
    if s.attention_sinks:  # one logit per head, split with the heads
        out.append(Tensor(f"{p}.sinks", (s.num_heads,), "col", "attention", i))
    if s.qk_norm:  # one RMSNorm weight per head dimension, shared by all heads: replicated under TP
        out += [Tensor(f"{p}.q_norm.weight", (s.head_dim,), "none", "norm", i),
                Tensor(f"{p}.k_norm.weight", (s.head_dim,), "none", "norm", i)]
    return out


# An expert's three matrices as its checkpoint names them: Mixtral's w1/w3/w2, Qwen3-MoE's gate/up/down.
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}


def _gated(x: str, names: tuple[str, str, str], f: int, h: int, group: str, i: int, bias: bool) -> list[Tensor]:
    """One gated MLP ``x`` of width ``f``: gate and up (hidden -> f, split by their outputs), down (f -> hidden,
    split by its inputs), and with ``bias`` their biases (down's replicated: added once, after the all-reduce)."""
    gate, up, down = (f"{x}.{n}" for n in names)
    out = [Tensor(f"{gate}.weight", (f, h), "col", group, i), Tensor(f"{up}.weight", (f, h), "col", group, i),
           Tensor(f"{down}.weight", (h, f), "row", group, i)]
    if bias:
        out += [Tensor(f"{gate}.bias", (f,), "col", group, i), Tensor(f"{up}.bias", (f,), "col", group, i),
                Tensor(f"{down}.bias", (h,), "none", group, i)]
    return out


GATED = ("gate_proj", "up_proj", "down_proj")


def _mlp(s: ModelSpec, p: str, i: int) -> list[Tensor]:
    h = s.hidden_size
    if not s.is_moe_layer(i):
        return _gated(p, GATED, s.intermediate_size, h, "mlp", i, s.mlp_bias)
    # a router, then each expert's gate, up and down matrices; some models add experts every token runs
    router = f"{p}.router" if s.family in ("gpt_oss", "llama4_text") else f"{p}.gate"
    out = [Tensor(f"{router}.weight", (s.num_experts, h), "none", "router", i)]
    if s.expert_bias:
        out.append(Tensor(f"{router}.bias", (s.num_experts,), "none", "router", i))
    names = _EXPERT_NAMES.get(s.family, GATED)
    for e in range(s.num_experts):
        out += _gated(f"{p}.experts.{e}", names, s.expert_width, h, "experts", i, s.expert_bias)
    if s.shared_experts:  # one dense MLP as wide as the shared experts together
        shared = f"{p}.shared_expert" if s.family == "llama4_text" else f"{p}.shared_experts"
        out += _gated(shared, GATED, s.expert_width * s.shared_experts, h, "mlp", i, False)
    return out


@functools.cache
def _tensors(s: ModelSpec) -> tuple[Tensor, ...]:
    out = [Tensor("model.embed_tokens.weight", (s.vocab_size, s.hidden_size), "vocab", "embedding")]
    mlp = {"mixtral": "block_sparse_moe", "llama4_text": "feed_forward"}.get(s.family, "mlp")
    for i in range(s.num_layers):
        p = f"model.layers.{i}"
        out.append(Tensor(f"{p}.input_layernorm.weight", (s.hidden_size,), "none", "norm", i))
        out += _attention(s, f"{p}.self_attn", i)
        out.append(Tensor(f"{p}.post_attention_layernorm.weight", (s.hidden_size,), "none", "norm", i))
        if s.sandwich_norms:
            out += [Tensor(f"{p}.{n}_feedforward_layernorm.weight", (s.hidden_size,), "none", "norm", i)
                    for n in ("pre", "post")]
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
    experts = param_breakdown(s)["experts"]  # every MoE layer has num_experts alike
    return total - experts + experts * s.experts_per_token // s.num_experts


def active_weight_bytes(model, dtype: str | None = None) -> int:
    """Bytes of weights one token's forward pass reads: all of them but the experts it is not routed to.

    Why: a decode step at batch 1 reads each weight it uses once, so this over the memory bandwidth bounds
    its speed; for a mixture of experts it is far below :func:`weight_bytes`, which bounds the memory.
    (The embedding table counts whole, though a token reads one row of it: a bound, a little high.)
    """
    s = model_spec(model)
    total = weight_bytes(s, dtype)
    if not s.num_experts:
        return total
    experts = -(-sum(_bits(s, t, dtype, t.numel, t.shape[0]) for t in tensors(s) if t.group == "experts") // 8)
    return total - experts + experts * s.experts_per_token // s.num_experts


def _checkpoint_bits(s: ModelSpec, t: Tensor, numel: int, rows: int) -> int:
    """Bits a (shard of a) tensor takes as stored in the checkpoint, fp8 scales included."""
    base = DTYPE_BITS[s.require_dtype()]
    if s.quant_method is None or not t.is_matrix or t.name.endswith(".bias"):
        return numel * base
    if t.module in s.not_quantized:
        return numel * base
    if s.quant_method == "mxfp4":  # gpt-oss: only the experts' matrices, 4 bits + one 8-bit scale per 32 values
        return numel * 4 + -(-numel // 32) * 8 if t.group == "experts" else numel * base
    if s.quant_method == "fp8" and s.quant_block:  # DeepSeek-V3: one float32 scale per block of weights
        bo, bi = s.quant_block
        return numel * 8 + -(-rows // bo) * -(-(numel // rows) // bi) * 32
    if s.quant_method != "fbgemm_fp8":
        raise ConfigError(f"{s.name}: quantization method {s.quant_method!r} is not modelled by llmlab.memory; "
                          "pass dtype='int4', 'int8' or 'fp8' for an estimate that counts every weight alike.")
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

def check_tp(model, tp: int, expert_parallel: bool = False) -> None:
    """Raise if vLLM could not shard this model ``tp`` ways (heads, KV heads, MLP width must divide).

    ``expert_parallel`` (vLLM's ``--enable-expert-parallel``): the experts are not sliced but dealt out whole
    to the ``tp`` GPUs, so their width need not divide; a dense model has no experts to deal.
    """
    s = model_spec(model)
    if expert_parallel and not s.num_experts:
        raise PlanError(f"{s.name} has no experts: expert parallelism applies to mixture-of-experts models only.")
    if tp < 1:
        raise PlanError(f"tensor parallel size must be >= 1, got {tp}")
    if s.num_heads % tp:
        raise PlanError(f"{s.name}: {s.num_heads} attention heads do not divide into {tp} tensor-parallel shards.")
    if s.num_kv_heads % tp and tp % s.num_kv_heads:
        raise PlanError(f"{s.name}: {s.num_kv_heads} KV heads can neither be split nor evenly replicated over {tp} "
                        "GPUs; use a TP size that divides them or that they divide.")
    widths = {s.intermediate_size} if len(s.dense_layers) or not s.num_experts else set()
    if s.shared_experts:
        widths.add(s.expert_width * s.shared_experts)
    sliced = widths | ({s.expert_width} if s.num_experts and not expert_parallel else set())
    for width in sorted(sliced):
        if width % tp:
            raise PlanError(f"{s.name}: MLP width {width} does not divide by TP={tp}.")
        if s.quant_block and width // tp % s.quant_block[0]:  # vLLM: "not divisible by weight quantization block_n"
            hint = " or deal the experts out whole (expert parallelism)" if width == s.expert_width else ""
            raise PlanError(f"{s.name}: TP={tp} cuts its {width}-wide MLP into slices of {width // tp}, not whole "
                            f"{s.quant_block[0]}-row blocks of its FP8 scales; use a smaller TP{hint}.")


def valid_tp_sizes(model, max_tp: int, expert_parallel: bool = False) -> list[int]:
    """TP sizes up to ``max_tp`` that vLLM accepts for this model."""
    out = []
    for tp in range(1, max_tp + 1):
        try:
            check_tp(model, tp, expert_parallel)
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


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """The layer numbers of each pipeline stage, split as :func:`pp_partition` counts them."""
    parts = pp_partition(num_layers, pp)
    return [range(sum(parts[:k]), sum(parts[:k + 1])) for k in range(pp)]


def _stage_of(t: Tensor, stages: list[range]) -> list[int]:
    last = len(stages) - 1
    if t.group == "embedding":
        return [0]
    if t.layer is None:  # final norm, LM head
        return [last]
    return [k for k, layers in enumerate(stages) if t.layer in layers]


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


def weight_bytes_per_gpu(model, dtype: str | None = None, tp: int = 1, pp: int = 1,
                         expert_parallel: bool = False) -> list[int]:
    """Bytes of weights one GPU of each pipeline stage holds (norms and routers are replicated).

    With tied embeddings and PP > 1 the last stage holds its own copy of the LM head, as vLLM does.  With
    ``expert_parallel`` each GPU holds whole experts, the first ones ceil(experts / tp) of each layer (vLLM
    deals them out in order), instead of a 1/tp slice of every expert; the rest is sharded as before.
    """
    s = model_spec(model)
    check_tp(s, tp, expert_parallel)
    return list(_weight_bytes_per_gpu(s, None if dtype is None else normalize_dtype(dtype), tp, pp, expert_parallel))


def _expert_index(t: Tensor) -> int:
    return int(t.name.split(".experts.")[1].split(".")[0])


@functools.cache
def _weight_bytes_per_gpu(s: ModelSpec, dtype: str | None, tp: int, pp: int, ep: bool = False) -> tuple[int, ...]:
    stages = stage_layers(s.num_layers, pp)
    bits = [0] * pp
    first_gpu_experts = -(-s.num_experts // tp)
    for t in tensors(s):
        if ep and t.group == "experts":
            if _expert_index(t) >= first_gpu_experts:
                continue
            numel, rows = t.numel, t.shape[0]
        else:
            numel, rows = _shard(s, t, tp)
        for k in _stage_of(t, stages):
            bits[k] += _bits(s, t, dtype, numel, rows)
    if s.tie_word_embeddings and pp > 1:
        head = tensors(s)[0]
        numel, rows = _shard(s, head, tp)
        bits[-1] += _bits(s, head, dtype, numel, rows)
    return tuple(-(-b // 8) for b in bits)
