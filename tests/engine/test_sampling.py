"""llmlab.sampling: hand-computed examples, properties, and a cross-check against vLLM's own sampler code.

This file holds the tests that start the real engine (or need root); the rest are in tests/unit/test_sampling.py
(the pure tests).
"""

from __future__ import annotations

from llmlab import sampling as S

# --------------------------------------------------------------------------------------------- the live server


def test_server_draws_follow_the_predicted_distribution(embedded):
    """500 seeded one-token draws from the real server at T=0.8, top_k=5 vs llmlab's prediction from logprobs.

    top_k=5 confines the draw to tokens the 20 logprobs list, so the prediction is exact and the observed
    total variation must stay under the distribution-free 99.9 % bound (a fixed seed keeps it reproducible).
    """
    import llmlab

    client, model = llmlab.connect(quiet=True)
    prompt = "And the king said to"
    top = S.next_token_distribution(client, model, prompt, k=20)
    params = S.SamplingParams(temperature=0.8, top_k=5)
    counts = S.sample_next_tokens(client, model, prompt, params, n=500, seed=1)
    expected = S.predicted(top, params)
    assert sum(counts.values()) == 500 and set(counts) <= set(expected)
    assert S.total_variation(counts, expected) < S.tv_bound(len(expected), 500)
    # ...and the test can fail: the same draws are far from the distribution at another temperature.
    wrong = S.predicted(top, S.SamplingParams(temperature=2.0, top_k=5))
    assert S.total_variation(counts, wrong) > S.total_variation(counts, expected)
