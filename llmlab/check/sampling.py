"""Checks of notebook 04, sampling parameters (``llmlab.sampling``): greedy decoding, the processors' survivors."""

from __future__ import annotations

from llmlab.check.verdict import _whole, require, right


def same_text(a: str, b: str) -> None:
    """04: two generations that must be identical."""
    require(isinstance(a, str) and isinstance(b, str), "store the generated *text* (choices[0].text) in both.")
    require(len(a) > 0, "the text is empty: did you set max_tokens?")
    require(a == b, f"they differ:\n  {a!r}\n  {b!r}\nOnly greedy decoding (temperature 0, or top_k=1) is "
            "deterministic without a seed.")
    right("identical: with only one candidate left at each step, sampling has nothing to choose from.")


def survivors(answer: int, client, model: str, prompt: str, **params) -> None:
    """04: how many of the top-20 next tokens survive the given sampling parameters."""
    import numpy as np

    from llmlab import sampling

    require(not isinstance(answer, np.ndarray | list | tuple), "that is the whole distribution; the answer is one "
            "number: how many of its probabilities are not zero (np.count_nonzero).")
    require(not isinstance(answer, str), "that is a string; store the count as a number (int(...)).")
    n = _whole(answer, "survivors", "a count of tokens is whole: count the non-zero probabilities.")
    top = sampling.next_token_distribution(client, model, prompt, k=20)

    def left(**knobs) -> int:
        return int(np.count_nonzero(sampling.probabilities(
            sampling.apply_processors(top.logits, sampling.SamplingParams(**knobs)))))

    expected = left(**params)
    if "temperature" in params and n != expected:
        without = {k: v for k, v in params.items() if k != "temperature"}
        require(n != left(**without), "that is what top_p leaves at temperature 1: you skipped temperature. vLLM "
                "divides the logits by it first, and that changes how many tokens top_p keeps.")
    require(n <= expected, f"too many: {n} tokens is more than the processors leave. Apply temperature first, then "
            "top_p (sampling.apply_processors does both, in vLLM's order), and count the non-zero probabilities.")
    require(n >= expected, f"too few: {n} tokens is fewer than the processors leave. Apply temperature first, then "
            "top_p (sampling.apply_processors does both, in vLLM's order), and count the non-zero probabilities.")
    right(f"{expected} tokens survive {params}.")
