"""The sampling lesson against a live server: the server's top-k logprobs, sampled counts, and the explorer.

Part of ``llmlab.sampling``: ``processors.py`` holds the parameters and the steps vLLM applies; here notebook 04
asks the server for its next-token distribution, predicts what the parameters do to it, and checks the
prediction against the server's own samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from llmlab.sampling.processors import SamplingParams, apply_processors, entropy, probabilities

# --------------------------------------------------------------------------------------------- server data


class TopLogprobs(NamedTuple):
    """A server's top-k alternatives for one position, most likely first, ready for the functions above."""

    tokens: list[str]
    logits: np.ndarray
    """The logprobs themselves; a softmax is blind to a constant shift, so they work as logits."""
    covered: float
    """Probability the listed tokens hold in the model's full distribution (1.0 would mean nothing is missing)."""


def _pair(item: Any) -> tuple[str, float]:
    if isinstance(item, Mapping):
        return str(item["token"]), float(item["logprob"])
    return str(item.token), float(item.logprob)


def from_top_logprobs(top: Mapping[str, float] | Sequence[Any]) -> TopLogprobs:
    """Turn one position's alternatives from a response into arrays, sorted most likely first.

    Accepts the completions form ``logprobs.top_logprobs[i]`` (a dict token -> logprob) and the chat form
    ``logprobs.content[i].top_logprobs`` (a list of ``{"token", "logprob"}`` dicts or openai objects).

    Only k tokens come back, so ``probabilities(result.logits)`` is *renormalised*: each listed token's
    probability is divided by ``result.covered``, the mass the k tokens really hold. The ratios between listed
    tokens stay exact, but the rest of the vocabulary is treated as impossible, which is the same as having
    applied ``top_k=k`` first. So probabilities come out too large, entropy too small, the effective vocabulary
    can never exceed k, and top-p/min-p only choose among the k. Keep ``covered`` in view when plotting.

    Two further caveats. vLLM returns *raw* logprobs (before penalties and temperature), which is what makes
    these arrays a fair input to :func:`apply_processors`. But a logprob is the logit minus a constant, so
    everything that is shift-invariant (temperature, top-k, top-p, min-p, frequency/presence penalties, bias)
    behaves exactly as on the server, whereas the repetition penalty does not: it depends on the sign of the
    real logit, and every logprob is negative. And the server writes ``-9999.0`` for a logprob of ``-inf``.
    """
    pairs = list(top.items()) if isinstance(top, Mapping) else [_pair(item) for item in top]
    if not pairs:
        raise ValueError("no alternatives given. Fix: request them with logprobs=k (completions) or "
                         "logprobs=True, top_logprobs=k (chat), with k >= 1.")
    pairs.sort(key=lambda pair: -float(pair[1]))
    logprobs = np.array([float(lp) for _, lp in pairs])
    return TopLogprobs([str(t) for t, _ in pairs], logprobs, float(np.exp(logprobs).sum()))


# --------------------------------------------------------------------------------------------- the live server


def next_token_distribution(client, model: str, prompt: str, k: int = 20) -> TopLogprobs:
    """The model's k most likely next tokens after ``prompt``, read from the server (raw logprobs)."""
    response = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=k)
    return from_top_logprobs(response.choices[0].logprobs.top_logprobs[0])


def sample_next_tokens(client, model: str, prompt: str, params: SamplingParams, n: int, seed: int = 0) -> dict:
    """Ask the server for ``n`` independent one-token continuations; return ``{token: count}``.

    One request with ``n`` choices (vLLM samples them in one batch), seeded so that a rerun gives the same counts.
    """
    kwargs = params.validate().openai_kwargs()
    kwargs.update(max_tokens=1, n=n, seed=seed)
    kwargs["extra_body"] = {**kwargs["extra_body"], "min_tokens": 0}
    response = client.completions.create(model=model, prompt=prompt, **kwargs)
    counts: dict[str, int] = {}
    for choice in response.choices:
        counts[choice.text] = counts.get(choice.text, 0) + 1
    return counts


def predicted(top: TopLogprobs, params: SamplingParams) -> dict[str, float]:
    """llmlab's prediction of the next-token distribution under ``params``, from the server's top-k logprobs.

    Exact when the parameters themselves confine sampling to the listed tokens (e.g. ``top_k`` <= k), because
    then the tokens the server did not list have probability 0 on the server too.
    """
    probs = probabilities(apply_processors(top.logits, params))
    return {token: float(p) for token, p in zip(top.tokens, probs, strict=True) if p > 0}


def total_variation(p: Mapping[str, float], q: Mapping[str, float]) -> float:
    """Half the L1 distance between two distributions (counts are normalised first): 0 = same, 1 = disjoint."""
    p_sum, q_sum = sum(p.values()), sum(q.values())
    keys = set(p) | set(q)
    return 0.5 * sum(abs(p.get(k, 0) / p_sum - q.get(k, 0) / q_sum) for k in keys)


def tv_bound(categories: int, n: int, confidence: float = 0.999) -> float:
    """A distribution-free bound on the total variation between n samples and their true distribution.

    With probability >= ``confidence``, TV <= sqrt(categories / (4 n)) + sqrt(ln(1 / (1 - confidence)) / (2 n)):
    the first term bounds the expected TV (Cauchy-Schwarz on the multinomial variances), the second is
    McDiarmid's inequality (changing one sample moves TV by at most 1/n).
    """
    return math.sqrt(categories / (4 * n)) + math.sqrt(math.log(1 / (1 - confidence)) / (2 * n))


def plot_distribution(ax, tokens: Sequence[str], before: np.ndarray, after: np.ndarray, title: str = "") -> None:
    """Bars of the next-token probabilities before (grey) and after (colour) the processors."""
    x = np.arange(len(tokens))
    ax.bar(x - 0.2, before, width=0.4, color="0.75", label="model (renormalised top-k)")
    ax.bar(x + 0.2, after, width=0.4, color="tab:blue", label="after sampling parameters")
    ax.set_xticks(x, [repr(t) for t in tokens], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("probability")
    ax.set_title(title)
    ax.legend(fontsize=8)


def explorer(top: TopLogprobs):
    """An ipywidgets explorer: sliders for temperature, top-k, top-p and min-p reshape the real distribution."""
    import ipywidgets as w
    import matplotlib.pyplot as plt

    before = probabilities(top.logits)

    def show(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        after = probabilities(apply_processors(top.logits, params))
        # The same summary as text above the plot: readable by a screen reader, and by the browser test.
        summary = (f"{np.count_nonzero(after)} of {len(top.tokens)} tokens left, entropy {entropy(after):.2f} bits, "
                   f"most likely {top.tokens[int(np.argmax(after))]!r} at {after.max():.1%}")
        print(summary)
        fig, ax = plt.subplots(figsize=(9, 3.5))
        plot_distribution(ax, top.tokens, before, after, summary.split(", most")[0])
        plt.show()

    label = {"description_width": "100px"}  # "temperature" whole, not cut to "temperat..."
    return w.interactive(show, temperature=w.FloatSlider(value=1.0, min=0.0, max=2.0, step=0.05, style=label),
                         top_k=w.IntSlider(value=0, min=0, max=len(top.tokens), style=label),
                         top_p=w.FloatSlider(value=1.0, min=0.05, max=1.0, step=0.05, style=label),
                         min_p=w.FloatSlider(value=0.0, min=0.0, max=1.0, step=0.01, style=label))
