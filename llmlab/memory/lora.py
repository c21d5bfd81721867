"""What a LoRA adapter weighs: its own parameters, and the slots vLLM reserves to serve adapters (lesson 17).

Why: an adapter replaces none of the base model's weights; each adapted matrix ``W`` (``out x in``) gains two
thin ones, ``A`` (``rank x in``) and ``B`` (``out x rank``), and the layer computes ``W x + (alpha / rank) B A x``.
So an adapter costs ``rank x (in + out)`` parameters per adapted matrix -- a fraction of a percent of the model
at the ranks people use -- and many adapters fit beside one copy of the base weights.  The engine, for its part,
keeps ``--max-loras`` slots of ``--max-lora-rank`` on the device for every adaptable layer, whichever adapters
fill them: that reservation, not the adapters on disk, is what comes out of the KV cache's budget.
"""

from __future__ import annotations

from llmlab.memory.model import ConfigError, bytes_per_param, model_spec, serve_dtype
from llmlab.memory.weights import param_count, tensors

# The linear layers of a Llama-family block, by the names Hugging Face and PEFT give them.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTENTION + MLP


def adapted_matrices(model, targets=ALL_LINEAR) -> list[tuple[str, int, int, str]]:
    """``(name, out, in, split)`` of every weight matrix an adapter of ``targets`` adapts: one per target per layer;
    ``split`` is how tensor parallelism cuts it (``row`` for o_proj and down_proj, by output for the others)."""
    targets = tuple(targets)
    unknown = [t for t in targets if t not in ALL_LINEAR]
    if unknown or not targets:
        raise ConfigError(f"LoRA targets {unknown or '(none)'}: name some of {', '.join(ALL_LINEAR)} "
                          "(the linear layers of a Llama-family block).")
    spec = model_spec(model)
    found = [(t.name, *t.shape, t.split) for t in tensors(spec)
             if len(t.shape) == 2 and t.name.rsplit(".", 2)[-2] in targets and ".layers." in t.name]
    if not found:
        raise ConfigError(f"{spec.name} has no {', '.join(targets)} matrices llmlab knows (an MoE's experts or "
                          "MLA's projections are named otherwise): LoRA arithmetic covers dense Llama-family blocks.")
    return found


def lora_params(model, rank: int, targets=ALL_LINEAR, tp: int = 1) -> int:
    """Parameters of one adapter of ``rank``: ``rank x (in + out)`` for each adapted matrix.

    With tensor parallelism ``tp``, what each GPU holds: vLLM cuts one matrix of each pair and keeps the other whole
    on every GPU (``vllm/lora/layers/``): for a layer split by its output (q, k, v, gate, up) ``B`` is cut and ``A``
    whole, for a layer split by its input (o, down) ``A`` is cut and ``B`` whole (``--fully-sharded-loras`` cuts
    both).  So each GPU holds more than ``1 / tp`` of an adapter."""
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank={rank!r}: a LoRA rank is a whole number of at least 1 (8 and 16 are common).")
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r}: tensor parallelism is a whole number of GPUs, at least 1.")

    def cut(n: int) -> int:
        return -(-n // tp)

    return sum(rank * (cut(n_in) + n_out if split == "row" else n_in + cut(n_out))
               for _, n_out, n_in, split in adapted_matrices(model, targets))


def lora_bytes(model, rank: int, targets=ALL_LINEAR, dtype: str | None = None, tp: int = 1) -> int:
    """Bytes of one adapter's weights in ``dtype`` (default: the model's serving dtype), on each of ``tp`` GPUs."""
    return int(lora_params(model, rank, targets, tp) * bytes_per_param(serve_dtype(model, dtype)))


def lora_slots_bytes(model, max_loras: int, max_rank: int, targets=ALL_LINEAR, dtype: str | None = None,
                     tp: int = 1) -> int:
    """What the engine reserves on each GPU for ``--max-loras`` adapters of up to ``--max-lora-rank``: a slot of the
    full rank for every adapted matrix, ``max_loras`` times, whether or not an adapter fills it (with ``tp``, each
    GPU's share of a slot is :func:`lora_params`'s)."""
    if not isinstance(max_loras, int) or max_loras < 1:
        raise ValueError(f"max_loras={max_loras!r}: the engine holds at least 1 adapter slot (--max-loras).")
    return max_loras * lora_bytes(model, max_rank, targets, dtype, tp)


def lora_share(model, rank: int, targets=ALL_LINEAR) -> float:
    """One adapter's parameters as a fraction of the base model's."""
    return lora_params(model, rank, targets) / param_count(model)
