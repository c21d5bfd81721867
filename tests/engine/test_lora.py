"""LoRA adapters (notebook 17, ``llmlab.lora``) against the real engine: the shipped adapters served beside the
base model, each answering in its own voice; vLLM's adapter equal, token for token, to its weights merged into the
base model in transformers; one adapter slot (``--max-loras 1``) making requests of two adapters take turns, counted
in engine steps; and the proxy keeping runtime adapter loading closed even where vLLM would open it.

One engine of its own (35-75 s to start on two cores): the shipped adapters, ``--max-loras 1``, and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (the route behind the proxy is then open in vLLM itself).  The pure tests
are in tests/unit/test_lora.py.
"""

import httpx
import pytest

import llmlab
from llmlab import batching, engines, lora
from llmlab.serve.paths import TINY_MODEL, TINY_NAME

PROMPTS = ["And the angel said to them,", "In the beginning God", "Then Jesus answered"]


@pytest.fixture(scope="module")
def served():
    srv = engines.start(lora.serve_args(max_loras=1), env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, progress=False)
    try:
        client, model = llmlab.connect(srv.base_url, srv.api_key, quiet=True)
        yield srv, client, model
    finally:
        srv.stop()


def test_the_adapters_are_listed_as_models_of_the_base(served):
    _, client, model = served
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {TINY_NAME, "kjv", "rv1909"} and model == TINY_NAME
    assert {getattr(cards[n], "parent", None) for n in ("kjv", "rv1909")} == {TINY_NAME}


def test_each_adapter_answers_in_its_voice_and_the_base_in_neither(served):
    _, client, model = served
    table = lora.side_by_side(client, PROMPTS, [model, "kjv", "rv1909"], max_tokens=48)
    mean = table.groupby("model")[["kjv words", "rv1909 words"]].mean()
    assert mean.loc["kjv", "kjv words"] > 2 * mean.loc[model, "kjv words"], mean
    assert mean.loc["rv1909", "rv1909 words"] > 0.25 > mean.loc[model, "rv1909 words"], mean
    assert len(set(table.groupby("prompt")["answer"].nunique())) == 1 and table.groupby("prompt")["answer"] \
        .nunique().iloc[0] == 3  # three different answers to every prompt


def test_the_served_adapter_is_its_weights_merged_into_the_base_model(served):
    """vLLM applies B A beside W on every step; transformers runs W + scale x B A merged: the same greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, client, _ = served
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    for name, path in lora.shipped().items():
        model = lora.merge(AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32).eval(), path)
        for prompt in PROMPTS[:2]:
            ids = tok(prompt, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                want = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
            got = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0,
                                            extra_body={"return_token_ids": True}).choices[0].token_ids
            assert list(got) == want.tolist()[:len(got)] and len(got) >= 12, (name, prompt)


def test_one_adapter_slot_makes_two_adapters_take_turns(served):
    """``--max-loras 1``: a step runs requests of one adapter only, so 4 + 4 requests of two adapters take at least
    twice the steps of one answer, where 8 of one adapter run side by side."""
    _, client, _ = served
    one = batching.measure(client, lora.send_mixed, client, {"kjv": 8}, 32)
    two = batching.measure(client, lora.send_mixed, client, {"kjv": 4, "rv1909": 4}, 32)
    for run in (one, two):
        assert run["alone"] and [r.output_tokens for r in run["result"].records] == [32] * 8
    assert 32 <= one["delta"]["steps"] < 2 * 32, one["delta"]
    assert two["delta"]["steps"] >= 2 * 32, two["delta"]


def test_the_proxy_keeps_runtime_adapter_loading_closed(served):
    srv, client, _ = served
    body = {"lora_name": "mine", "lora_path": str(lora.shipped()["kjv"])}
    # vLLM itself, on its private socket, loads an adapter by a path when asked (the environment opened the route)
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(srv.uds)), timeout=60) as direct:
        loaded = direct.post("http://vllm/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200, loaded.text
    # the proxy, which is all that everyone else reaches, refuses both routes with the key, and says what to do
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        answer = httpx.post(f"http://{srv.host}:{srv.port}{route}", json=body, timeout=30,
                            headers={"Authorization": f"Bearer {srv.api_key}"})
        assert answer.status_code == 403 and "--lora-modules" in answer.text, answer.text
    assert {m.id for m in client.models.list().data} == {TINY_NAME, "kjv", "rv1909", "mine"}  # not unloaded
