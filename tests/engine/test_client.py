"""Reading real responses of the embedded vLLM server (notebook 03's helpers)."""

import openai
import pytest

import llmlab
from llmlab import client as lc


@pytest.fixture(scope="module")
def conn(embedded):
    return llmlab.connect(quiet=True)


def test_annotate_explains_every_standard_field(conn):
    client, model = conn
    response = client.completions.create(model=model, prompt="In the beginning", max_tokens=5, temperature=0)
    table = lc.annotate(response).set_index("field")
    for path in ["id", "object", "created", "model", "choices[0].text", "choices[0].finish_reason",
                 "usage.prompt_tokens", "usage.completion_tokens", "usage.total_tokens"]:
        assert path in table.index, path
        assert "extension" not in table.loc[path, "meaning"]
    assert table.loc["usage.completion_tokens", "value"] == 5
    assert "UTC" in table.loc["created", "value"]


def test_stream_equals_non_streamed_greedy_text(conn):
    client, model = conn
    seen = []
    streamed = lc.stream_completion(client, model, "The Lord is my shepherd", max_tokens=20, temperature=0,
                                    on_text=seen.append)
    whole = client.completions.create(model=model, prompt="The Lord is my shepherd", max_tokens=20, temperature=0)
    assert streamed.text == whole.choices[0].text == "".join(seen)
    assert 0 < streamed.ttft <= streamed.total and len(streamed.inter_token_gaps) == len(streamed.chunks) - 1
    assert streamed.usage.completion_tokens == whole.usage.completion_tokens
    assert streamed.finish_reason == whole.choices[0].finish_reason


def test_bad_parameter_is_a_400_named_in_one_sentence(conn):
    client, model = conn
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="Hello", temperature=5.0)
    sentence = lc.describe_error(err.value)
    assert sentence.startswith("HTTP 400") and "temperature" in sentence and "\n" not in sentence


def test_stop_string_ends_with_stop_reason(conn):
    client, model = conn
    r = client.completions.create(model=model, prompt="The king said", max_tokens=100, temperature=0, stop=[","])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == ","
    assert "," not in r.choices[0].text


def test_same_seed_same_text(conn):
    client, model = conn
    texts = [client.completions.create(model=model, prompt="The king said", max_tokens=12, temperature=1.0,
                                       seed=s).choices[0].text for s in (3, 3, 4, 5)]
    assert texts[0] == texts[1]
    assert len(set(texts)) >= 2  # three different seeds at temperature 1 do not all agree
