"""Determinism (notebook 14, ``llmlab.determinism``): the kernel-level cause without a server, and the live
engine's answers repeated -- idle, under load, from the prefix cache -- and sampled with a seed.

This file holds the tests that start the real engine (or need root); the rest are in tests/unit/test_determinism.py
(the pure tests).
"""

import pytest

import llmlab
from llmlab import determinism

PROMPT = "And God said, Let there be light: and there was light."
LOAD = [f"Verse {i}: In the beginning" for i in range(16)]


@pytest.fixture(scope="module")
def conn(embedded):
    return llmlab.connect(quiet=True)


@pytest.mark.server
def test_the_same_greedy_request_twice_gives_the_same_bits(conn):
    """Computed from scratch both times (fresh cache salts): the engine repeats itself to the last bit.  Under load
    it does too on vLLM's CPU kernels (the notebook shows it); that is the kernels' property, not a promise, so
    only the idle case is a test -- and that the load really runs beside the request."""
    client, model = conn
    a, b = (determinism.answer(client, model, PROMPT) for _ in range(2))
    same = determinism.drift(a, b)
    assert (same["prompt_max"], same["answer_max"], same["same_tokens"]) == (0.0, 0.0, True)
    loaded = determinism.under_load(client, model, PROMPT, LOAD, concurrency=8)
    assert loaded.usage.prompt_tokens == a.usage.prompt_tokens and determinism.drift(a, loaded)["prompt_max"] >= 0
    with pytest.raises(ValueError, match="at least one other prompt"):
        determinism.under_load(client, model, PROMPT, [])


@pytest.mark.server
def test_a_seed_repeats_a_sampled_answer(conn):
    client, model = conn

    def sample(seed):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=1.0,
                                         seed=seed).choices[0].text
    assert sample(7) == sample(7) != sample(8)
