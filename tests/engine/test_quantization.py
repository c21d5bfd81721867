"""Quantization (notebook 11, ``llmlab.quantization``): the arithmetic of fp8 weights and an fp8 KV cache, the checks'
hints, and the real CPU engine with an fp8 KV cache -- its logged KV tokens and its logprobs.  The CPU build's refusal
of fp8 weights is asked live by ``make test-versions`` (tests/engine/test_vllm_versions.py), against the record that
notebook 11's section 4 prints.

This file holds the tests that start the real engine (or need root); the rest are in tests/unit/test_quantization.py
(the pure tests).
"""


import pytest

import llmlab
from llmlab import quantization


@pytest.fixture(scope="module")
def conn(embedded):
    return llmlab.connect(quiet=True)


PROMPTS = ["The first king of Israel was", "In the beginning God created the heaven and the earth.",
           "And Moses said unto the people,", "Blessed are they that mourn: for they shall be comforted."]


@pytest.mark.server
def test_the_float32_cache_asked_twice_drifts_by_nothing(conn):
    """What makes notebook 11's drift the fp8 cache's: the default server asked twice gives bitwise the same
    logprobs and tokens.  The fp8 server itself (its KV line to the token, a drift above 0 and below the measured
    bounds) is asserted by notebook 11's cells, which `make test` runs under nbval in the same session: starting it
    here again cost 54 s of CI (issue 23)."""
    client, model = conn
    reference = [quantization.ask(client, model, p) for p in PROMPTS]
    again = [quantization.ask(client, model, p) for p in PROMPTS]
    for a, b in zip(reference, again, strict=True):
        same = quantization.drift(a, b)
        assert same["prompt_max"] == 0 and same["same_tokens"] and same["answer_max"] == 0
    with pytest.raises(ValueError, match="not of the same prompt"):
        quantization.drift(reference[0], again[1])
