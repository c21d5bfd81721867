"""Checks of notebook 05, logprobs (``llmlab.logprobs``): a prompt token's rank, the most likely option."""

from __future__ import annotations

from llmlab.check.verdict import require, right


def prompt_rank(answer: int, client, model: str, text: str, token: str) -> None:
    """05: the rank of ``token`` inside ``text``'s prompt logprobs."""
    from llmlab import logprobs

    table = logprobs.score_text(client, model, text)
    expected = int(table.loc[table["token"] == token, "rank"].iloc[0])
    require(answer == expected, f"{answer} is not the rank the server reports. Request "
            "extra_body={'prompt_logprobs': 1} and read the 'rank' of that position (logprobs.score_text does).")
    right(f"{token!r} ranks {expected} among the model's candidates at its position.")


def best_choice(answer: str, client, model: str, prompt: str, options: list[str]) -> None:
    """05: the option with the highest summed logprob after ``prompt``."""
    from llmlab import logprobs

    expected = logprobs.score_choices(client, model, prompt, options).loc[0, "option"]
    require(answer in options, f"{answer!r} is not one of {options} (keep the leading space).")
    require(answer == expected, f"{answer!r} is not the most likely: sum the logprobs of each option's tokens "
            "after the prompt and take the largest.")
    right(f"{expected!r} has the highest summed log-probability.")
