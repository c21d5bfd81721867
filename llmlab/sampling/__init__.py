"""Sampling parameters, as vLLM applies them (notebook 04).

Read in this order: ``processors.py`` -- the parameters with vLLM's checks, and every step vLLM applies to the
logits, in vLLM's order, as plain numpy; ``server.py`` -- the same against a live server: its top-k logprobs,
the prediction of what the parameters do to them, the server's own samples, and the explorer widget.  Every
name is importable from ``llmlab.sampling``.
"""

from llmlab.sampling.processors import (  # noqa: F401
    LOGIT_BIAS_LIMIT,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    NEG_INF,
    SAMPLING_EPS,
    STEPS,
    SamplingParams,
    apply_frequency_penalty,
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_presence_penalty,
    apply_processors,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    effective_vocabulary,
    entropy,
    greedy,
    log_probabilities,
    probabilities,
    sample,
    trace,
)
from llmlab.sampling.server import (  # noqa: F401
    TopLogprobs,
    explorer,
    from_top_logprobs,
    next_token_distribution,
    plot_distribution,
    predicted,
    sample_next_tokens,
    total_variation,
    tv_bound,
)
