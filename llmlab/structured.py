"""Structured output (notebook 10): a grammar that decides which tokens the model may pick next.

Why: a program that reads a model's answer needs it in a form it can parse -- one of a list, a pattern, a JSON
object.  vLLM compiles such a constraint into a grammar and, before every sampling step, masks every token that
cannot continue a valid answer: the same kind of logits processor as notebook 04's top-k, applied first.  The
model still chooses, but only among what the grammar allows.

On the wire it is one request parameter, ``extra_body={"structured_outputs": {...}}`` (or the OpenAI
``response_format`` on the chat endpoint); :func:`constraint` builds it and refuses a malformed one before the
server does.  :func:`grammar_steps` reads what the mask did from the answer's logprobs.
"""

from __future__ import annotations

import re

import pandas as pd

from llmlab.logprobs import token_records

# vLLM reports a token the grammar ruled out with this logprob (it is -inf inside the engine).
MASKED = -9999.0


def constraint(*, choice: list[str] | None = None, regex: str | None = None, json: dict | None = None) -> dict:
    """The ``extra_body`` of a request whose answer must be one of ``choice``, match ``regex`` or follow the JSON
    schema ``json``: exactly one of them."""
    given = {k: v for k, v in (("choice", choice), ("regex", regex), ("json", json)) if v is not None}
    if len(given) != 1:
        raise ValueError(f"give exactly one of choice=, regex= or json= (got {sorted(given) or 'none'}): a grammar "
                         "is one of them.")
    if choice is not None and (not choice or not all(isinstance(c, str) and c for c in choice)):
        raise ValueError(f"choice={choice!r}: give a non-empty list of non-empty strings.")
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"regex={regex!r} does not compile ({e}): fix it before the server refuses it.") from None
    if json is not None and not isinstance(json, dict):
        raise ValueError(f"json= takes a JSON schema as a dict, not {type(json).__name__}.")
    return {"structured_outputs": given}


def grammar_steps(response, choice: int = 0) -> pd.DataFrame:
    """One row per generated token of an answer asked with logprobs (completions or chat): the token, its logprob,
    and how many of the most likely tokens the grammar had ruled out at that step (vLLM reports them at
    ``MASKED``).  The tokens are read by notebook 05's :func:`llmlab.logprobs.token_records`."""
    return pd.DataFrame([{"token": r["token"], "logprob": r["logprob"],
                          "masked in top": sum(lp <= MASKED for _, lp in r["alternatives"]),
                          "allowed in top": [t for t, lp in r["alternatives"] if lp > MASKED]}
                         for r in token_records(response, choice)])
