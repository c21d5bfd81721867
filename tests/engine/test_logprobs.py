"""llmlab.logprobs: parsing responses shaped like vLLM's (built by hand, by the openai client and by vLLM itself).

This file holds the tests that start the real engine (or need root); the rest are in tests/unit/test_logprobs.py
(the pure tests).
"""

from __future__ import annotations

import pandas as pd

from llmlab import logprobs as L

# --------------------------------------------------------------------------------------------- the live server


def test_live_completion_and_chat_tables(embedded):
    import llmlab

    client, model = llmlab.connect(quiet=True)
    r = client.completions.create(model=model, prompt="In the beginning", max_tokens=6, temperature=0, logprobs=3)
    table = L.logprob_table(r)
    assert len(table) == 6 and table["is_top1"].all()
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=3)
    assert len(L.logprob_table(chat)) == chat.usage.completion_tokens


def test_live_prompt_scores_and_choices(embedded):
    import llmlab

    client, model = llmlab.connect(quiet=True)
    verse = L.score_text(client, model, "In the beginning, God created the heavens and the earth.")
    assert pd.isna(verse["logprob"].iloc[0]) and verse["rank"].iloc[1:].min() >= 1
    assert verse["token"].iloc[-1] == "." and len(verse) >= 12
    shuffled = L.score_text(client, model, "earth the God heavens, and beginning the created In the.")
    assert L.perplexity(verse) < L.perplexity(shuffled) == L.perplexity(shuffled["logprob"])
    choices = L.score_choices(client, model, "In the beginning, God created the heavens and the",
                              [" earth.", " sea.", " king."])
    assert choices.loc[0, "option"] == " earth." and (choices["tokens"] >= 1).all()
