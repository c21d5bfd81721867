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
4. GPUs (:mod:`~llmlab.memory.gpus`): what vLLM may use of one (:func:`usable_bytes`) and
   :func:`gpus_needed` (how many cards' worth of memory);
5. :func:`layout_fit` (:mod:`~llmlab.memory.fit`): whether one TP x PP layout holds the requests, and why
   not -- the one answer that the planner, ``llmlab launch``, ``llmlab generate`` and notebook 01 share;
6. :func:`plan` (:mod:`~llmlab.memory.planner`): the smallest layout that fits, and its ``vllm serve`` line;
7. :func:`plot_gpu` (:mod:`~llmlab.memory.picture`): one GPU of a plan as stacked bars against its size;
8. :func:`transformers_param_count` (:mod:`~llmlab.memory.reference`): the referee, transformers' own model
   built from the config on the meta device (no weights), which every formula above must agree with;
9. :func:`predict_kv_before_launch` (:mod:`~llmlab.memory.startup`): the KV pool vLLM 0.26 will log, before
   launch, with every byte it reserves besides it (weights as loaded, the profile run's activation peak,
   non-torch memory, the CUDA-graph estimate where subtracted).

Units: bytes are exact integers; ``GB`` is 10**9 bytes (datasheets, published tables) and ``GiB`` is
2**30 bytes (what vLLM and PyTorch print).  The difference is 7 %, larger than many of the margins.
"""

# The parts (their reading order is the list above); every name stays reachable as llmlab.memory.<name>.
from llmlab.memory import lora  # noqa: F401  (notebook 17: memory.lora.lora_params and its neighbours, a module)
from llmlab.memory.fit import Fit, layout_fit  # noqa: F401
from llmlab.memory.gpus import (  # noqa: F401
    _GPU_ALIASES,
    GPU,
    GPUS,
    GPUCount,
    _gib,
    _usable_or_fail,
    gpu,
    gpus_needed,
    usable_bytes,
)
from llmlab.memory.kv import (  # noqa: F401
    CPU_BATCHED_TOKENS,
    GPU_IN_FLIGHT_TOKENS,
    KV_LOG,
    KVCapacity,
    KVLayout,
    embedded_kv_capacity,
    kv_blocks,
    kv_budget,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_capacity,
    kv_capacity_of,
    kv_groups,
    kv_layout,
    kv_tokens,
    kv_tokens_held,
    max_concurrency,
    parse_kv_log,
)
from llmlab.memory.model import (  # noqa: F401
    ARCHITECTURES,
    CONFIGS_DIR,
    CPU_BLOCK_SIZE,
    CPU_MLA_BLOCK_SIZE,
    DEFAULT_OVERHEAD_GIB,
    DEFAULT_UTILIZATION,
    DTYPE_ALIASES,
    DTYPE_BITS,
    FLOAT_DTYPES,
    GB,
    GPU_BLOCK_SIZE,
    HF_IDS,
    KV_DTYPES,
    MODELS_DIR,
    TINY_NAME,
    ConfigError,
    GiB,
    ModelSpec,
    PlanError,
    UnknownName,
    UnsupportedArchitecture,
    _bool_field,
    _family,
    _head_dim,
    _int_field,
    _quantization,
    _sliding_window,
    _spec_from_config,
    _torch_dtype,
    bytes_per_param,
    config_path,
    kv_dtype_bytes,
    load_config,
    model_spec,
    normalize_dtype,
    normalize_kv_dtype,
    serve_dtype,
    shipped_models,
)
from llmlab.memory.picture import gpu_parts, plot_gpu  # noqa: F401
from llmlab.memory.planner import Plan, memory_report, plan, serve_args, serve_command, serve_flags  # noqa: F401
from llmlab.memory.reference import transformers_param_count  # noqa: F401
from llmlab.memory.startup import (  # noqa: F401
    FITTED,
    StartupMemory,
    activation_peak_bytes,
    gpu_of_total,
    loaded_weight_bytes,
    predict_kv_before_launch,
    rotary_cache_bytes,
)
from llmlab.memory.weights import (  # noqa: F401
    Tensor,
    _attention,
    _bits,
    _checkpoint_bits,
    _mlp,
    _shard,
    _stage_of,
    _tensors,
    _weight_bytes_per_gpu,
    active_params,
    active_weight_bytes,
    check_tp,
    param_breakdown,
    param_count,
    pp_partition,
    stage_layers,
    tensors,
    valid_tp_sizes,
    weight_bytes,
    weight_bytes_per_gpu,
)
