"""Checks of notebook 04, sampling parameters (``llmlab.sampling``): greedy decoding, the processors' survivors."""

from __future__ import annotations

from llmlab.check.verdict import require, right


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

    top = sampling.next_token_distribution(client, model, prompt, k=20)
    expected = int(np.count_nonzero(sampling.probabilities(
        sampling.apply_processors(top.logits, sampling.SamplingParams(**params)))))
    require(answer == expected, f"{answer} is not what the processors leave; apply temperature first, then top_p "
            "(sampling.apply_processors does both, in vLLM's order), and count the non-zero probabilities.")
    right(f"{expected} tokens survive {params}.")
