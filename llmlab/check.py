"""Check cells for the exercises: ``llmlab.check.<exercise>(answer)`` says right or wrong.

Each function prints one line starting with "Right:" when the answer is correct, and otherwise raises
``NotYet`` whose message says what is still wrong -- so an unsolved exercise fails loudly in nbval,
and a learner sees a hint instead of a bare assertion.
"""

from __future__ import annotations


class NotYet(AssertionError):
    """The answer is not right yet; the message says why."""


def require(condition: bool, hint: str) -> None:
    if not condition:
        raise NotYet(f"Not yet: {hint}")


def right(message: str) -> None:
    print(f"Right: {message}")


def first_completion(response, expected_tokens: int = 5) -> None:
    """00_setup: a completion of exactly ``expected_tokens`` tokens, cut by the length limit."""
    require(response is not None and hasattr(response, "usage"),
            "pass the object that client.completions.create(...) returned.")
    require(getattr(response, "object", None) == "text_completion",
            f"expected a completion (object 'text_completion'), got {getattr(response, 'object', None)!r}; "
            "use client.completions.create, not chat.")
    n = response.usage.completion_tokens
    require(n == expected_tokens, f"the server generated {n} tokens; ask for max_tokens={expected_tokens}.")
    reason = response.choices[0].finish_reason
    require(reason == "length", f"finish_reason is {reason!r}: the model stopped on its own before "
            f"{expected_tokens} tokens. Add ignore_eos through extra_body, or try another prompt.")
    right(f"{n} tokens, finish_reason 'length': the server stopped because max_tokens was reached.")
