"""What vLLM does to the logits before it picks a token: the sampling parameters, as plain numpy.

Part of ``llmlab.sampling`` (read this module first, then ``server.py``).

Every function here takes logits (one row of shape ``(vocab,)``, or a batch ``(..., vocab)``) and returns a
new array; nothing is changed in place, so a notebook can keep each intermediate step and plot it.
:func:`trace` runs the whole chain and returns every step; :func:`apply_processors` returns only the end.

The order, as read in vLLM 0.32 (``vllm/v1/sample/``), for one decoding step of one request:

0. ``Sampler.forward`` (``sampler.py``) first takes a copy of the *raw* log-softmax for the ``logprobs`` the
   server returns (default ``logprobs_mode="raw_logprobs"``). So the logprobs in a response describe the model
   before any step below: temperature, penalties and top-k do not show up in them.
1. The logits are cast to float32; ``allowed_token_ids`` and ``bad_words`` masks are applied
   (``Sampler.apply_logits_processors``; not modelled here).
2. The built-in logits processors that can change the argmax run next, in the order of
   ``BUILTIN_LOGITS_PROCESSORS`` (``logits_processor/__init__.py``), implemented in ``logits_processor/builtin.py``:

   a. ``MinTokensLogitsProcessor.apply``: while fewer than ``min_tokens`` tokens have been generated, every
      stop token id gets ``-inf``: ``stop_token_ids`` plus the EOS id(s) of the tokenizer and generation config,
      which the engine adds even with ``ignore_eos`` (``SamplingParams.update_from_generation_config``).
      Stop *strings* are matched later, on the decoded text, by the detokenizer (``v1/engine/detokenizer.py``,
      ``BaseIncrementalDetokenizer.update``); it too honours ``min_tokens``: it checks only once more than
      ``min_tokens`` tokens exist, and only text after the first ``min_tokens`` tokens.  So ``min_tokens`` holds
      off both kinds of stop; this module models the token-level part.
   b. ``LogitBiasLogitsProcessor.apply``: adds ``logit_bias[token]`` (clamped to [-100, 100] when the request
      is parsed, ``SamplingParams.from_optional``).
3. Penalties, ``Sampler.apply_penalties`` -> ``ops/penalties.py: apply_all_penalties`` ->
   ``model_executor/layers/utils.py: apply_penalties``, in this order:

   a. repetition (``_custom_ops.apply_repetition_penalties_torch``): for every token seen in the prompt *or*
      the output, a positive logit is divided by the penalty and a negative one multiplied by it;
   b. frequency: ``logit -= frequency_penalty * count`` where ``count`` is how often the token occurs in the
      *output only*;
   c. presence: ``logit -= presence_penalty * (count > 0)``, output only as well.
4. ``Sampler.sample``: a request with temperature below ``1e-5`` is greedy: the argmax of the logits *as they are
   now* is the token (``Sampler.greedy_sample``). Penalties and bias therefore still act on greedy decoding;
   temperature, min-p, top-k and top-p do not (``SamplingParams.__post_init__`` even resets them).
5. ``Sampler.apply_temperature``: logits are divided by the temperature.
6. The argmax-invariant processors: ``MinPLogitsProcessor.apply`` computes the softmax of the *temperature-scaled*
   logits and removes every token whose probability is below ``min_p * max_probability``.
7. ``TopKTopPSampler`` -> ``apply_top_k_top_p`` (``ops/topk_topp_sampler.py``; on CPU the pytorch variants
   ``apply_top_k_only`` / ``apply_top_k_top_p_pytorch``, on GPU a Triton or FlashInfer kernel for the same rule):
   top-k keeps the tokens whose logit is at least the k-th largest (ties survive), *then* top-p computes the
   softmax of what is left, sorts it ascending and drops the tokens whose cumulative probability, summed from
   the least likely up, is ``<= 1 - top_p`` (the most likely token always survives).
8. Softmax and a random draw (``random_sample``: the argmax of ``probs / q`` with ``q ~ Exponential(1)``, which is
   a draw from ``probs``; the CPU build fuses the same idea as Gumbel-max).

Two more rules from ``vllm/sampling_params.py`` and the input batch: a temperature in ``(0, 0.01)`` is raised to
0.01 (so only ``temperature=0`` is greedy through the API), and ``top_k`` of 0, -1 or at least the vocabulary
size means "no top-k" (``gpu_input_batch.py``).

Because temperature comes before top-p and min-p, the temperature changes *how many* tokens those two keep;
top-k does not care (dividing by a positive number keeps the ranking). Because top-k comes before top-p, top-p
measures its mass inside the renormalised top-k set, which keeps fewer tokens than the other order would.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SAMPLING_EPS = 1e-5
"""Below this temperature vLLM samples greedily (``_SAMPLING_EPS`` in vLLM)."""
MIN_TEMPERATURE = 1e-2
"""vLLM raises a temperature in (0, MIN_TEMPERATURE) to MIN_TEMPERATURE to avoid inf/nan (``_MAX_TEMP``)."""
MAX_TEMPERATURE = 2.0
LOGIT_BIAS_LIMIT = 100.0

NEG_INF = -np.inf


# --------------------------------------------------------------------------------------------- parameters


def _invalid(name: str, value: Any, allowed: str, fix: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not accepted: vLLM allows {allowed}. Fix: {fix}.")


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_range(name: str, value: Any, low: float, high: float, fix: str) -> None:
    if not _is_real(value) or not low <= value <= high:
        raise _invalid(name, value, f"a number in [{low:g}, {high:g}]", fix)


@dataclass
class SamplingParams:
    """The per-request sampling knobs of vLLM's OpenAI server, with vLLM's defaults and checks.

    Only the parameters that change which token comes next (plus the stopping ones a course talks about);
    :meth:`openai_kwargs` turns them into arguments for ``client.completions.create``.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    max_tokens: int | None = 16
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the parameter, its value, vLLM's allowed range and the fix; else return self.

        The ranges are those of ``SamplingParams._verify_args`` in vLLM, so a learner meets the error here,
        with a plainer message, instead of as an HTTP 400 from the server.
        """
        _check_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE,
                     "use 0 for greedy decoding, about 0.7-1.0 for varied text, never more than 2")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _invalid("top_p", self.top_p, "a number in (0, 1]", "use 1.0 to switch top-p off, e.g. 0.9 to keep "
                           "the most likely tokens that hold 90% of the probability")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _invalid("top_k", self.top_k, "an integer: 0 or -1 (off) or at least 1",
                           "use 0 to switch top-k off, or a whole number such as 50")
        _check_range("min_p", self.min_p, 0.0, 1.0, "use 0 to switch min-p off, e.g. 0.05")
        for name in ("frequency_penalty", "presence_penalty"):
            _check_range(name, getattr(self, name), -2.0, 2.0, f"use 0 for no {name.split('_')[0]} penalty; "
                         "positive values discourage repeats, negative ones encourage them")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise _invalid("repetition_penalty", self.repetition_penalty, "a finite number > 0",
                           "use 1.0 for no penalty, values above 1 (e.g. 1.2) discourage repeats")
        self._validate_lengths()
        self._validate_stops()
        if self.seed is not None and not _is_int(self.seed):
            raise _invalid("seed", self.seed, "an integer or None", "pass a whole number such as 1234, or None")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or not _is_real(bias):
                raise _invalid("logit_bias", {token: bias}, "a mapping of integer token id -> number",
                               "write e.g. {1234: -5.0}; vLLM clamps biases to [-100, 100]")
        return self

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _invalid("max_tokens", self.max_tokens, "an integer >= 1 (or None: up to the context length)",
                           "ask for at least one token, e.g. max_tokens=64")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _invalid("min_tokens", self.min_tokens, "an integer >= 0", "use 0 to let the model stop any time")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _invalid("min_tokens", self.min_tokens, f"at most max_tokens={self.max_tokens}",
                           "lower min_tokens or raise max_tokens")

    def _validate_stops(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise _invalid("stop", self.stop, "non-empty strings", "remove the empty string from stop")
        if any(not _is_int(t) for t in self.stop_token_ids):
            raise _invalid("stop_token_ids", self.stop_token_ids, "integer token ids", "pass ids such as [128009]")

    @property
    def effective_temperature(self) -> float:
        """The temperature vLLM really uses: values in (0, 0.01) are raised to 0.01 to avoid overflow."""
        return max(self.temperature, MIN_TEMPERATURE) if self.temperature > 0 else float(self.temperature)

    @property
    def is_greedy(self) -> bool:
        """True when vLLM takes the argmax: only temperature == 0 through the API (see MIN_TEMPERATURE)."""
        return self.effective_temperature < SAMPLING_EPS

    def openai_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``client.completions.create`` (or chat), vLLM-only knobs in ``extra_body``.

        Every value is sent, defaults included, so the server's own defaults (taken from the model's
        ``generation_config.json``) never silently replace what the notebook shows.
        """
        kwargs: dict[str, Any] = {
            "temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
            "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
        }
        if self.seed is not None:
            kwargs["seed"] = self.seed
        if self.stop:
            kwargs["stop"] = self.stop
        if self.logit_bias:
            kwargs["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        extra: dict[str, Any] = {"top_k": self.top_k, "min_p": self.min_p, "min_tokens": self.min_tokens,
                                 "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos}
        if self.stop_token_ids:
            extra["stop_token_ids"] = list(self.stop_token_ids)
        kwargs["extra_body"] = extra
        return kwargs


# --------------------------------------------------------------------------------------------- basics


def _logits(logits: Any) -> np.ndarray:
    x = np.array(logits, dtype=np.float64)  # a copy: no step ever changes the caller's array
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"logits must have a vocabulary axis (last axis, length >= 1), got shape {x.shape}")
    return x


def probabilities(logits: Any) -> np.ndarray:
    """Softmax over the last axis; ``-inf`` logits get probability exactly 0.

    Shift-invariant, which is why log-probabilities can be used as logits (see :func:`from_top_logprobs`).
    """
    x = _logits(logits)
    top = np.max(x, axis=-1, keepdims=True)
    if not np.all(np.isfinite(top)):
        raise ValueError("every token of a row is masked (-inf) or a logit is +inf/nan: nothing left to sample")
    e = np.exp(x - top)
    return e / e.sum(axis=-1, keepdims=True)


def log_probabilities(logits: Any) -> np.ndarray:
    """Log-softmax over the last axis (what vLLM returns as ``logprobs``, before any processing)."""
    x = _logits(logits)
    top = np.max(x, axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def sample(probs: Any, rng: np.random.Generator | int | None = None) -> int | np.ndarray:
    """Draw one token id per row, the way vLLM does: ``argmax(probs / q)`` with ``q ~ Exponential(1)``.

    This "exponential race" is an exact draw from ``probs`` that needs no cumulative sum, so a whole batch is
    sampled at once without a CPU-GPU sync. ``rng`` is a numpy Generator or a seed; a vLLM ``seed`` gives a
    different (torch) random stream, so the same seed does not give the same token here and on the server.
    """
    p = np.asarray(probs, dtype=np.float64)
    q = np.random.default_rng(rng).exponential(size=p.shape)
    with np.errstate(divide="ignore"):
        token = np.argmax(p / q, axis=-1)
    return int(token) if np.ndim(token) == 0 else token


def entropy(probs: Any, base: float = 2.0) -> float | np.ndarray:
    """Shannon entropy of each row, in bits by default: 0 for a certain choice, log2(n) for n equal tokens."""
    p = np.asarray(probs, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, -p * np.log(p), 0.0)
    h = terms.sum(axis=-1) / math.log(base)
    return float(h) if np.ndim(h) == 0 else h


def effective_vocabulary(probs: Any, mass: float = 0.9) -> int | np.ndarray:
    """How many of the most likely tokens it takes to hold ``mass`` of the probability (per row).

    A rounder number than entropy for a plot: "at temperature 1.5 the next token is one of ~40 candidates".
    """
    if not 0 < mass <= 1:
        raise ValueError(f"mass={mass!r} must be in (0, 1]. Fix: use e.g. 0.9 for 90% of the probability.")
    p = np.sort(np.asarray(probs, dtype=np.float64), axis=-1)[..., ::-1]
    cumulative = np.cumsum(p, axis=-1)
    count = np.argmax(cumulative >= mass * cumulative[..., -1:] - 1e-12, axis=-1) + 1
    return int(count) if np.ndim(count) == 0 else count


# --------------------------------------------------------------------------------------------- the steps


def _counts(token_ids: Iterable[int], vocab: int, what: str) -> np.ndarray:
    ids = np.asarray(list(token_ids), dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        bad = ids[(ids < 0) | (ids >= vocab)][0]
        raise ValueError(f"{what} holds token id {bad}, outside the logits' vocabulary of {vocab} tokens. "
                         "Fix: pass ids that index the same logits array (same tokenizer, same truncation).")
    return np.bincount(ids, minlength=vocab)


def apply_min_tokens(logits: Any, num_generated: int, min_tokens: int, stop_token_ids: Iterable[int]) -> np.ndarray:
    """Forbid every stop token (EOS included) while fewer than ``min_tokens`` tokens have been generated.

    vLLM: ``MinTokensLogitsProcessor``.  Stop strings are not tokens: vLLM's detokenizer holds them off for the
    first ``min_tokens`` tokens (see the module docstring), not this processor.
    """
    x = _logits(logits)
    ids = [int(t) for t in stop_token_ids if t is not None]
    if num_generated < min_tokens and ids:
        _counts(ids, x.shape[-1], "stop_token_ids")
        x[..., ids] = NEG_INF
    return x


def apply_logit_bias(logits: Any, logit_bias: Mapping[int, float] | None) -> np.ndarray:
    """Add a fixed bias to chosen tokens (clamped to [-100, 100] as vLLM does); -100 practically bans a token."""
    x = _logits(logits)
    for token, bias in (logit_bias or {}).items():
        _counts([int(token)], x.shape[-1], "logit_bias")
        x[..., int(token)] += min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(bias)))
    return x


def apply_repetition_penalty(logits: Any, prompt_ids: Iterable[int], output_ids: Iterable[int],
                             penalty: float) -> np.ndarray:
    """Make every token already seen (prompt or output) less likely, whatever the sign of its logit.

    Dividing a positive logit and multiplying a negative one both move it towards "less likely"; that is why the
    rule depends on the sign (vLLM: ``apply_repetition_penalties_torch``). A penalty < 1 does the opposite.
    """
    x = _logits(logits)
    vocab = x.shape[-1]
    seen = (_counts(prompt_ids, vocab, "prompt_ids") > 0) | (_counts(output_ids, vocab, "output_ids") > 0)
    factor = np.where(seen, penalty, 1.0)
    return np.where(x > 0, x / factor, x * factor)


def apply_frequency_penalty(logits: Any, output_ids: Iterable[int], penalty: float) -> np.ndarray:
    """Subtract ``penalty`` once per earlier occurrence in the *output* (the prompt does not count), as in OpenAI."""
    x = _logits(logits)
    return x - penalty * _counts(output_ids, x.shape[-1], "output_ids")


def apply_presence_penalty(logits: Any, output_ids: Iterable[int], penalty: float) -> np.ndarray:
    """Subtract ``penalty`` once from every token that occurs in the *output* at all, however often."""
    x = _logits(logits)
    return x - penalty * (_counts(output_ids, x.shape[-1], "output_ids") > 0)


def greedy(logits: Any) -> np.ndarray:
    """Keep only the argmax (first one on ties, like ``torch.argmax``): temperature 0 as a distribution."""
    x = _logits(logits)
    best = np.argmax(x, axis=-1)[..., None]
    return np.where(np.arange(x.shape[-1]) == best, x, NEG_INF)


def apply_temperature(logits: Any, temperature: float) -> np.ndarray:
    """Divide the logits by the temperature; below 1e-5 this is greedy decoding (only the argmax survives).

    Dividing by T > 1 shrinks the gaps between logits (flatter, more random); T < 1 stretches them (sharper).
    """
    if temperature < SAMPLING_EPS:
        return greedy(logits)
    return _logits(logits) / temperature


def apply_min_p(logits: Any, min_p: float) -> np.ndarray:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's probability.

    A cut relative to the leader: strict when the model is sure, lenient when it is not. vLLM runs it on the
    temperature-scaled logits (``MinPLogitsProcessor``).
    """
    x = _logits(logits)
    if min_p <= 0:
        return x
    p = probabilities(x)
    return np.where(p < min_p * p.max(axis=-1, keepdims=True), NEG_INF, x)


def apply_top_k(logits: Any, top_k: int) -> np.ndarray:
    """Keep the ``top_k`` largest logits (all tokens tied with the k-th too); 0, -1 or >= vocab means off."""
    x = _logits(logits)
    vocab = x.shape[-1]
    if top_k <= 0 or top_k >= vocab:
        return x
    kth = np.partition(x, vocab - top_k, axis=-1)[..., vocab - top_k, None]
    return np.where(x < kth, NEG_INF, x)


def apply_top_p(logits: Any, top_p: float) -> np.ndarray:
    """Keep the most likely tokens until their probability reaches ``top_p`` (nucleus sampling).

    Same recipe as vLLM: sort ascending, drop every token whose cumulative probability is ``<= 1 - top_p``,
    always keep the last (most likely) one. A token survives when the tokens above it hold less than ``top_p``.
    """
    x = _logits(logits)
    if top_p >= 1:
        return x
    order = np.argsort(x, axis=-1, kind="stable")
    ascending = np.take_along_axis(x, order, axis=-1)
    drop = np.cumsum(probabilities(ascending), axis=-1) <= 1 - top_p
    drop[..., -1] = False
    out = np.empty_like(x)
    np.put_along_axis(out, order, np.where(drop, NEG_INF, ascending), axis=-1)
    return out


# --------------------------------------------------------------------------------------------- the chain


STEPS = ("input", "min_tokens", "logit_bias", "repetition_penalty", "frequency_penalty", "presence_penalty",
         "temperature", "min_p", "top_k", "top_p")
"""The step names :func:`trace` returns, in vLLM's order (a greedy request ends at "temperature")."""


def _stop_ids(params: SamplingParams, eos_id: int | None) -> list[int]:
    return ([] if eos_id is None else [int(eos_id)]) + [int(t) for t in params.stop_token_ids]


def trace(logits: Any, params: SamplingParams, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
          eos_id: int | None = None) -> list[tuple[str, np.ndarray]]:
    """Run vLLM's chain for one decoding step and return ``[(step name, logits after it), ...]``.

    ``output_ids`` are the tokens generated so far (they drive min_tokens and the frequency/presence penalties),
    ``prompt_ids`` the prompt's (repetition penalty only), ``eos_id`` the tokenizer's end-of-sequence id.
    A greedy request (temperature 0) stops after "temperature" with only the argmax left, since vLLM resets
    min-p, top-k and top-p for it.
    """
    params.validate()
    x = _logits(logits)
    steps = [("input", x)]

    def step(name: str, value: np.ndarray) -> np.ndarray:
        steps.append((name, value))
        return value

    x = step("min_tokens", apply_min_tokens(x, len(output_ids), params.min_tokens, _stop_ids(params, eos_id)))
    x = step("logit_bias", apply_logit_bias(x, params.logit_bias))
    x = step("repetition_penalty", apply_repetition_penalty(x, prompt_ids, output_ids, params.repetition_penalty))
    x = step("frequency_penalty", apply_frequency_penalty(x, output_ids, params.frequency_penalty))
    x = step("presence_penalty", apply_presence_penalty(x, output_ids, params.presence_penalty))
    x = step("temperature", apply_temperature(x, params.effective_temperature))
    if params.is_greedy:
        return steps
    x = step("min_p", apply_min_p(x, params.min_p))
    x = step("top_k", apply_top_k(x, params.top_k))
    step("top_p", apply_top_p(x, params.top_p))
    return steps


def apply_processors(logits: Any, params: SamplingParams, prompt_ids: Sequence[int] = (),
                     output_ids: Sequence[int] = (), eos_id: int | None = None) -> np.ndarray:
    """The logits vLLM samples from after every processor (see :func:`trace` for the arguments and the steps).

    ``probabilities(apply_processors(...))`` is the distribution the next token is drawn from.
    """
    return trace(logits, params, prompt_ids, output_ids, eos_id)[-1][1]
