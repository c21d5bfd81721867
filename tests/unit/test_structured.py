"""Structured output (notebook 10, ``llmlab.structured``): constraints built and refused locally, and obeyed by the
real engine -- its mask visible in the logprobs.

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/engine/test_structured.py (the tests that start the real engine).
"""


import pytest

from llmlab import structured


def test_a_malformed_constraint_is_refused_before_anything_is_sent():
    assert structured.constraint(choice=["a", "b"]) == {"structured_outputs": {"choice": ["a", "b"]}}
    for kwargs, message in (({}, "exactly one of choice=, regex= or json="),
                            ({"choice": ["a"], "regex": "a"}, r"got \['choice', 'regex'\]"),
                            ({"choice": []}, "non-empty list"), ({"choice": ["a", ""]}, "non-empty strings"),
                            ({"regex": "[A-Z"}, "does not compile"), ({"json": "{}"}, "not str")):
        with pytest.raises(ValueError, match=message):
            structured.constraint(**kwargs)
