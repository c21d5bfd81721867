"""The referee for parameter counts: transformers' own model, built from the config on the meta device.

Part of ``llmlab.memory`` (its ``__init__`` says how the parts fit).  Why: the per-tensor formulas of
:mod:`~llmlab.memory.weights` are what notebook 01 teaches, and a formula can be wrong in a way no reader
notices (a forgotten norm, a bias, an expert's width).  transformers' modelling code is what the checkpoints
are made from; on PyTorch's meta device a model has shapes but no storage, so counting even a 671B model
takes well under a second, allocates nothing and downloads nothing.  It also counts architectures that
llmlab has no formula for, which is how a learner can check any config.json.
"""

from __future__ import annotations

import functools
import json

from llmlab.memory.model import ConfigError, _language_model, load_config

# model_types whose checkpoints load with another's modelling code (Kimi K2 names its own type so that engines
# can tell it apart, and ships DeepSeek-V3's code under it); vLLM maps them the same way (transformers_utils).
SAME_CODE_AS = {"kimi_k2": "deepseek_v3"}


def transformers_param_count(model) -> int:
    """Parameters of ``model`` (a shipped name, a config path or a dict) as transformers builds it.

    A tied LM head is counted once, as ``model.parameters()`` does.  The config's
    ``quantization_config`` is left out: it changes how weights are stored, not how many there are, and
    building a quantized model would need the quantization kernels installed.
    """
    cfg, _ = load_config(model)
    cfg, _ = _language_model(cfg, "config")  # a vision-language model: its language model, as llmlab counts it
    cfg.pop("quantization_config", None)
    return _count(json.dumps(cfg, sort_keys=True))


@functools.cache
def _count(cfg_json: str) -> int:
    import torch
    import transformers

    cfg = json.loads(cfg_json)
    model_type = cfg.pop("model_type", None)
    model_type = SAME_CODE_AS.get(model_type, model_type)
    if not model_type:
        raise ConfigError("the config has no 'model_type', so transformers cannot tell which model it describes: "
                          "add the model_type of its config.json (e.g. \"llama\").")
    try:
        config = transformers.AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"transformers {transformers.__version__} does not know model_type {model_type!r} ({e}); "
                          "a newer transformers may.") from None
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in built.parameters())
