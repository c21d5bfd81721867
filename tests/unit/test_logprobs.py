"""llmlab.logprobs: parsing responses shaped like vLLM's (built by hand, by the openai client and by vLLM itself).

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/engine/test_logprobs.py (the tests that start the real engine).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from llmlab import logprobs as L

LN2 = math.log(2)

# " is" was not the model's favourite (" has" was); the other two were.
COMPLETION = {
    "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny",
    "choices": [{
        "index": 0, "text": " Paris is nice", "finish_reason": "length", "stop_reason": None,
        "logprobs": {
            "tokens": [" Paris", " is", " nice"],
            "token_logprobs": [-0.1, -2.0, -0.7],
            "top_logprobs": [{" Paris": -0.1, " Lyon": -3.0}, {" is": -2.0, " has": -0.5},
                             {" Lyon": -1.5, " nice": -0.7}],
            "text_offset": [12, 18, 21],
        },
        "prompt_logprobs": [
            None,
            {"24661": {"logprob": -8.53, "rank": 284, "decoded_token": "San"},
             "14924": {"logprob": -1.16, "rank": 1, "decoded_token": "Question"}},
            {"12": {"logprob": -0.3, "rank": 1, "decoded_token": " Francisco"}},
        ],
        "prompt_token_ids": [128000, 24661, 12],
    }],
    "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
}

CHAT = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "tiny",
    "choices": [{
        "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi there"},
        "logprobs": {"content": [
            {"token": "Hi", "logprob": -0.2, "bytes": [72, 105],
             "top_logprobs": [{"token": "Hello", "logprob": -1.9, "bytes": None},
                              {"token": "Hi", "logprob": -0.2, "bytes": None}]},
            {"token": " there", "logprob": -1.2, "bytes": None,
             "top_logprobs": [{"token": "!", "logprob": -0.6, "bytes": None},
                              {"token": " there", "logprob": -1.2, "bytes": None}]},
        ]},
    }],
    "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
    "prompt_logprobs": [None, {"5": {"logprob": -0.4, "rank": 1, "decoded_token": " world"}}],
}


def test_completion_table_by_hand():
    table = L.logprob_table(COMPLETION)
    assert list(table.columns) == L.TABLE_COLUMNS
    assert table["token"].tolist() == [" Paris", " is", " nice"]
    np.testing.assert_allclose(table["prob"], np.exp([-0.1, -2.0, -0.7]))
    np.testing.assert_allclose(table["surprise_bits"], [0.1 / LN2, 2.0 / LN2, 0.7 / LN2])
    assert table["rank"].tolist() == [1, 2, 1]
    assert table["is_top1"].tolist() == [True, False, True]
    assert table["top_token"].tolist() == [" Paris", " has", " nice"]
    assert table["text_offset"].tolist() == [12, 18, 21]
    assert table.loc[2, "alternatives"][0] == (" nice", pytest.approx(math.exp(-0.7)))


def test_chat_table_by_hand():
    table = L.logprob_table(CHAT)
    assert table["token"].tolist() == ["Hi", " there"]
    assert table["rank"].tolist() == [1, 2]
    assert table["top_token"].tolist() == ["Hi", "!"]  # sorted by logprob, not by the order sent
    assert table["text_offset"].isna().all()


def test_sampled_token_outside_top_k_gets_rank_k_plus_1():
    # logprobs=1 and the sampled token was not the favourite: the server sends both (numbers from the slides).
    choice = {"logprobs": {"tokens": ["20"], "token_logprobs": [-4.0059], "top_logprobs": [{"20": -4.0059,
                                                                                             "49": -1.7559}]}}
    row = L.logprob_table(choice).iloc[0]
    assert row["rank"] == 2 and not row["is_top1"] and row["top_token"] == "49"


def test_echoed_prompt_token_without_logprob_is_skipped():
    choice = {"logprobs": {"tokens": ["A", " b"], "token_logprobs": [None, -1.0],
                           "top_logprobs": [None, {" b": -1.0}], "text_offset": [0, 1]}}
    table = L.logprob_table(choice)
    assert math.isnan(table.loc[0, "logprob"]) and table["rank"].isna()[0]
    assert L.sequence_logprob(table) == pytest.approx(-1.0)
    assert L.perplexity(choice) == pytest.approx(math.e)


def test_sequence_logprob_and_perplexity_by_hand():
    assert L.sequence_logprob(COMPLETION) == pytest.approx(-2.8)
    assert L.perplexity(COMPLETION) == pytest.approx(math.exp(2.8 / 3))
    assert L.perplexity(L.logprob_table(CHAT)) == pytest.approx(math.exp(1.4 / 2))
    assert L.perplexity([0.0, 0.0]) == 1.0  # certain every time
    assert L.perplexity([math.log(0.25)] * 4) == pytest.approx(4.0)  # like a fair choice among 4


def test_surprise_in_bits_and_other_bases():
    np.testing.assert_allclose(L.surprise([-LN2, math.log(1 / 1024)]), [1.0, 10.0])
    np.testing.assert_allclose(L.surprise([-1.0], base=math.e), [1.0])
    np.testing.assert_allclose(L.surprise(COMPLETION), [0.1 / LN2, 2.0 / LN2, 0.7 / LN2])


def test_openai_objects_read_like_their_json():
    completion = Completion.model_validate(COMPLETION)
    assert completion.choices[0].model_extra["prompt_logprobs"]  # vLLM's field arrives as an extra
    assert L.logprob_table(completion).equals(L.logprob_table(COMPLETION))
    assert L.logprob_table(completion.choices[0]).equals(L.logprob_table(COMPLETION))
    assert L.prompt_table(completion).equals(L.prompt_table(COMPLETION))
    chat = ChatCompletion.model_validate(CHAT)
    assert L.logprob_table(chat).equals(L.logprob_table(CHAT))
    assert L.top1_guesses(chat) == [None, True]


def test_missing_logprobs_say_how_to_request_them():
    bare = json.loads(json.dumps(COMPLETION))
    bare["choices"][0]["logprobs"] = None
    with pytest.raises(ValueError, match="logprobs=k"):
        L.logprob_table(bare)
    del bare["choices"][0]["prompt_logprobs"]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        L.prompt_table(bare)
    with pytest.raises(ValueError, match="no choice 3"):
        L.logprob_table(COMPLETION, choice=3)


def test_prompt_table_uses_the_prompt_token_ids_and_ranks():
    table = L.prompt_table(COMPLETION)
    assert table["token"].isna()[0] and table["token"].tolist()[1:] == ["San", " Francisco"]
    assert table["token_id"].tolist()[1:] == [24661, 12] and table["token_id"].tolist()[0] == 128000
    assert table["rank"].tolist()[1:] == [284, 1]
    assert table.loc[1, "top_token"] == "Question" and table.loc[1, "top_logprob"] == pytest.approx(-1.16)
    assert L.top1_guesses(COMPLETION) == [None, False, True]
    assert L.sequence_logprob(table) == pytest.approx(-8.83)


def test_prompt_logprobs_as_a_bare_list_without_ids_use_the_first_entry():
    positions = COMPLETION["choices"][0]["prompt_logprobs"]
    assert L.top1_guesses(positions) == [None, False, True]
    # with explicit ids the prompt's own token is found wherever it is listed
    reordered = [None, dict(reversed(list(positions[1].items()))), positions[2]]
    assert L.prompt_table(reordered, prompt_token_ids=[1, 24661, 12]).loc[1, "token"] == "San"
    assert L.prompt_table(reordered).loc[1, "token"] == "Question"  # first entry, as documented
    with pytest.raises(ValueError, match="2 ids but prompt_logprobs 3 positions"):
        L.prompt_table(positions, prompt_token_ids=[1, 2])
    with pytest.raises(ValueError, match="prompt token id 99 is missing from position 1"):
        L.prompt_table(positions, prompt_token_ids=[1, 99, 12])


def test_chat_prompt_logprobs_live_on_the_response():
    table = L.prompt_table(CHAT)
    assert table["token"].tolist()[1:] == [" world"] and table["token_id"].isna()[0] and table["token"].isna()[0]


def test_vllms_own_objects_and_wire_format():
    """Responses serialised by vLLM's protocol classes, and its in-process Logprob objects with int keys."""
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
        from vllm.entrypoints.openai.completion.protocol import CompletionResponse
        from vllm.logprobs import Logprob
    except Exception as exc:  # noqa: BLE001 - any import failure means "no vLLM here"
        pytest.skip(f"vLLM's protocol classes cannot be imported here: {exc}")
    prompt = [None, {24661: Logprob(-8.53, 284, "San"), 14924: Logprob(-1.16, 1, "Question")},
              {12: Logprob(-0.3, 1, " Francisco")}]
    assert L.top1_guesses(prompt) == [None, False, True]
    choice = {key: COMPLETION["choices"][0][key] for key in ("index", "text", "finish_reason", "logprobs")}
    wire = json.loads(CompletionResponse(model="tiny", choices=[{**choice, "prompt_logprobs": prompt}],
                                         usage=COMPLETION["usage"]).model_dump_json())
    assert L.logprob_table(wire).equals(L.logprob_table(COMPLETION))
    assert L.top1_guesses(wire) == [None, False, True]
    chat = {key: CHAT["choices"][0][key] for key in ("index", "message", "logprobs")}
    chat_wire = json.loads(ChatCompletionResponse(model="tiny", choices=[chat], usage=CHAT["usage"],
                                                  prompt_logprobs=prompt).model_dump_json())
    assert L.logprob_table(ChatCompletion.model_validate(chat_wire)).equals(L.logprob_table(CHAT))
    assert L.top1_guesses(ChatCompletion.model_validate(chat_wire)) == [None, False, True]
