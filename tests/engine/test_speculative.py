"""Speculative decoding (notebook 12, ``llmlab.speculative``): flags refused before vLLM sees them, the textbook
formula, the counters' arithmetic, the shipped draft model's vocabulary, and a plain engine taking one pass per
token.

The drafting engines themselves are asserted by notebook 12's cells, which ``make test`` runs under nbval in the
same session: the same greedy text and logprobs (within 1e-4) as the plain engine, drafts of k tokens, a loop
drafted whole (acceptance > 0.9, more than 3 tokens per pass), acceptance that falls with the position, and the
draft model's engine giving the plain engine's text with drafts of k tokens.  A second
drafting engine here only started the same engine again (56 s of CI's `make test`, issue 23).

This file holds the tests that start the real engine (or need root); the rest are in tests/unit/test_speculative.py
(the pure tests).
"""


import pytest

import llmlab
from llmlab import speculative

OPENERS = ["The LORD is my shepherd", "In the beginning", "And the king said unto", "Now there was a man"]


@pytest.mark.server
def test_a_plain_server_takes_one_pass_per_token(embedded):
    client, model = llmlab.connect(quiet=True)
    row = speculative.measure(client, model, OPENERS, concurrency=2, max_tokens=16)
    assert (row["acceptance"], row["tokens per step"]) == (0.0, 1.0)
    assert row["tokens/s"] > 0 and row["latency p50 (ms)"] > 0
