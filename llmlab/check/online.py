"""Checks of a completion the server returned: the first request (notebooks 00 and 08) and notebook 03's
output format (``llmlab.client``): why generation ended, ``finish_reason`` and ``stop_reason``.
"""

from __future__ import annotations

from llmlab.check.verdict import require, right


def first_completion(response, expected_tokens: int = 5) -> None:
    """00_setup (and 08): a completion of exactly ``expected_tokens`` tokens, cut by the length limit."""
    require(response is not None and hasattr(response, "usage"),
            "pass the object that client.completions.create(...) returned: the check reads its usage and "
            "finish_reason.")
    require(getattr(response, "object", None) == "text_completion",
            f"expected a completion (object 'text_completion'), got {getattr(response, 'object', None)!r}; "
            "use client.completions.create, not chat.")
    n = response.usage.completion_tokens
    require(n == expected_tokens, f"the server generated {n} tokens; ask for max_tokens={expected_tokens}.")
    reason = response.choices[0].finish_reason
    require(reason == "length", f"finish_reason is {reason!r}: the model stopped on its own before "
            f"{expected_tokens} tokens. Add ignore_eos through extra_body, or try another prompt.")
    right(f"{n} tokens, finish_reason 'length': the server stopped because max_tokens was reached.")


def ended_by_model(response, at_least: int) -> None:
    """03: the model ended the text itself (EOS, not a stop string), after at least ``at_least`` tokens."""
    require(not isinstance(response, str), "that is the text; pass the whole response that "
            "client.completions.create(...) returned: the check reads its finish_reason and usage.")
    require(not hasattr(response, "finish_reason"), "that is one choice (response.choices[0]); pass the whole "
            "response: the token count is in response.usage.")
    require(hasattr(response, "choices") and hasattr(response, "usage"), "pass the response that "
            "client.completions.create(...) returned: the check reads its finish_reason and usage.")
    choice = response.choices[0]
    n = response.usage.completion_tokens
    require(choice.finish_reason == "stop", f"finish_reason is {choice.finish_reason!r}: give the model room "
            "(a larger max_tokens), and sample (temperature > 0) so it does not loop -- or, if it already samples "
            "and still loops, try another seed.")
    require(choice.stop_reason is None, f"it stopped at your stop string {choice.stop_reason!r}, not at the model's "
            "own end-of-text token; leave `stop` out.")
    require(n >= at_least, f"only {n} tokens: ask the server to mask the end-of-text token until {at_least} "
            "tokens with extra_body={'min_tokens': ...}.")
    right(f"{n} tokens, then the model's own end-of-text token (finish_reason 'stop', stop_reason None).")


def stopped_at(response, stop: str) -> None:
    """03: generation ended at the stop string ``stop`` (which is not part of the text)."""
    choice = response.choices[0]
    require(choice.stop_reason == stop, f"stop_reason is {choice.stop_reason!r}; pass stop=[{stop!r}].")
    require(stop not in choice.text, f"{stop!r} is in the text: the server cuts the text before the first stop "
            "string and leaves it out, unless asked to keep it (include_stop_str_in_output); leave that out.")
    right(f"finish_reason {choice.finish_reason!r}, stop_reason {choice.stop_reason!r}: cut before the first {stop!r}.")
