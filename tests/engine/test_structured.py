"""Structured output (notebook 10, ``llmlab.structured``): constraints built and refused locally, and obeyed by the
real engine -- its mask visible in the logprobs.

This file holds the tests that start the real engine (or need root); the rest are in tests/unit/test_structured.py
(the pure tests).
"""

import re
from pathlib import Path

import openai
import pytest

import llmlab
from llmlab import structured
from llmlab.client import describe_error


@pytest.fixture(scope="module")
def conn(embedded):
    return llmlab.connect(quiet=True)


@pytest.mark.server
def test_the_engine_samples_only_what_the_grammar_allows(conn):
    client, model = conn
    kings = ["Saul", "David", "Solomon"]
    r = client.completions.create(model=model, prompt="The first king of Israel was", max_tokens=8, temperature=1.0,
                                  seed=3, logprobs=5, extra_body=structured.constraint(choice=kings))
    assert r.choices[0].text in kings and r.choices[0].finish_reason == "stop"
    steps = structured.grammar_steps(r)
    assert steps["masked in top"].sum() > 0  # the mask is in the logprobs: ruled-out tokens at -9999
    assert all(set(top) for top in steps["allowed in top"])
    pattern = r"[A-Z][a-z]{1,10} [0-9]{1,3}:[0-9]{1,3}"
    r = client.completions.create(model=model, prompt="Blessed are they", max_tokens=40, temperature=0,
                                  extra_body=structured.constraint(regex=pattern))
    assert re.fullmatch(pattern, r.choices[0].text) and r.choices[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="no logprobs"):
        structured.grammar_steps(r)


@pytest.mark.server
def test_a_grammar_the_server_cannot_compile_is_a_400_with_its_reason(conn):
    client, model = conn
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="In", max_tokens=4, extra_body={"structured_outputs": {
            "regex": "[A-Z"}})
    said = describe_error(err.value)
    assert said.startswith("HTTP 400: the server refused the request") and "regex" in said.lower()


@pytest.mark.server
def test_an_old_guided_field_is_answered_200_unconstrained_and_only_the_log_says_so(conn, embedded):
    """Lesson 10's trap: vLLM removed ``guided_choice`` & co. (0.12); a request that carries one is served without
    any constraint, and the server's log carries the only warning."""
    client, model = conn
    kings = ["Saul", "David", "Solomon"]
    r = client.completions.create(model=model, prompt="The first king of Israel was", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": kings})
    assert r.choices[0].text not in kings and r.choices[0].finish_reason == "length"
    log = Path(embedded.log).read_text(errors="replace")
    assert "removed guided-decoding field(s) ['guided_choice']" in log and "will NOT be constrained" in log
