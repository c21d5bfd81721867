"""What a LoRA adapter weighs: its own parameters, and the slots vLLM reserves to serve adapters (lesson 17).

Why: an adapter replaces none of the base model's weights; each adapted matrix ``W`` (``out x in``) gains two
thin ones, ``A`` (``rank x in``) and ``B`` (``out x rank``), and the layer computes ``W x + (alpha / rank) B A x``.
So an adapter costs ``rank x (in + out)`` parameters per adapted matrix -- a fraction of a percent of the model
at the ranks people use -- and many adapters fit beside one copy of the base weights.  The engine, for its part,
keeps ``--max-loras`` slots of ``--max-lora-rank`` on the device for every adaptable layer, whichever adapters
fill them: that reservation, not the adapters on disk, is what comes out of the KV cache's budget.  For a Llama-family
model "every adaptable layer" is the seven linear ones of each block *and* the embedding and the LM head
(:data:`VOCABULARY`), whose slots are as long as the vocabulary.
"""

from __future__ import annotations

from llmlab.memory.model import ConfigError, bytes_per_param, model_spec, serve_dtype
from llmlab.memory.weights import param_count, tensors

# The linear layers of a Llama-family block, by the names Hugging Face and PEFT give them.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTENTION + MLP
# The two layers as wide as the vocabulary that vLLM also gives slots: LlamaForCausalLM.embedding_modules names them
# (vllm/model_executor/models/llama.py); get_supported_lora_modules adds them to the linear ones (vllm/lora/utils.py).
VOCABULARY = ("embed_tokens", "lm_head")
# The only values --max-lora-rank accepts (MaxLoRARanks in vllm/config/lora.py): a rank-12 adapter needs 16.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


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


def vocabulary_slot_params(model, rank: int, targets=VOCABULARY) -> int:
    """Parameters of one slot of ``rank`` in the embedding and the LM head (those of :data:`VOCABULARY` that
    ``targets`` names): ``rank x (vocab + hidden)`` each, whole on every GPU whatever the tensor parallelism.

    The embedding's slot (``VocabParallelEmbeddingWithLoRA``, ``vllm/lora/layers/vocab_parallel_embedding.py``) is
    ``A`` of ``vocab x rank`` and ``B`` of ``hidden x rank``; the LM head's (``LogitsProcessorWithLoRA``, which vLLM
    puts in place of the logits processor, ``vllm/lora/layers/logits_processor.py``) is ``A`` of ``rank x hidden``
    and ``B`` of ``vocab x rank``.  Tied embeddings change nothing: the LM head stays a module of its own."""
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank={rank!r}: a LoRA rank is a whole number of at least 1 (8 and 16 are common).")
    spec = model_spec(model)
    return sum(rank * (spec.vocab_size + spec.hidden_size) for t in VOCABULARY if t in tuple(targets))


def lora_slots_bytes(model, max_loras: int, max_rank: int, targets=None, dtype: str | None = None,
                     tp: int = 1) -> int:
    """What the engine reserves on each GPU for ``--max-loras`` adapters of up to ``--max-lora-rank``: a slot of the
    full rank for every adaptable layer, ``max_loras`` times, whether or not an adapter fills it.

    ``targets`` is what ``--lora-target-modules`` names; ``None``, vLLM's default, is every layer it can adapt: the
    seven linear ones of each block (with ``tp``, each GPU's share is :func:`lora_params`'s) and the embedding and
    LM head (:func:`vocabulary_slot_params`)."""
    if not isinstance(max_loras, int) or max_loras < 1:
        raise ValueError(f"max_loras={max_loras!r}: the engine holds at least 1 adapter slot (--max-loras).")
    if max_rank not in MAX_LORA_RANKS:
        raise ValueError(f"max_rank={max_rank!r}: --max-lora-rank takes only {', '.join(map(str, MAX_LORA_RANKS))}; "
                         f"pass the next one up from the adapters' largest rank (memory.lora.allowed_rank).")
    targets = ALL_LINEAR + VOCABULARY if targets is None else tuple(targets)
    linear = tuple(t for t in targets if t not in VOCABULARY)
    vocabulary = vocabulary_slot_params(model, max_rank, targets)
    params = vocabulary + (lora_params(model, max_rank, linear, tp) if linear or not vocabulary else 0)
    return max_loras * int(params * bytes_per_param(serve_dtype(model, dtype)))


def allowed_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds adapters of ``rank`` (:data:`MAX_LORA_RANKS`)."""
    fits = [r for r in MAX_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"rank={rank!r}: vLLM serves adapters of rank {MAX_LORA_RANKS[-1]} at most.")
    return fits[0]


def lora_share(model, rank: int, targets=ALL_LINEAR) -> float:
    """One adapter's parameters as a fraction of the base model's."""
    return lora_params(model, rank, targets) / param_count(model)
