"""LoRA adapters (notebook 17, ``llmlab.lora``) against the real engine, where the lesson does not go: one adapter
slot (``--max-loras 1``) making requests of two adapters take turns, counted in engine steps, and the proxy keeping
runtime adapter loading closed even where vLLM itself opens it.  The lesson's own cells assert the rest on its engine
(two slots): the adapters listed under their base model, each answering in its voice, vLLM's adapter equal token
for token to its weights merged into the base model in transformers, the two adapters side by side in one step.

One engine of its own (35-75 s to start on two cores): the shipped adapters, ``--max-loras 1``, and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``.  The pure tests are in tests/unit/test_lora.py.
"""

import httpx
import pytest

import llmlab
from llmlab import batching, engines, lora
from llmlab.serve.paths import TINY_NAME


@pytest.fixture(scope="module")
def served():
    srv = engines.start(lora.serve_args(max_loras=1), env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, progress=False)
    try:
        client, model = llmlab.connect(srv.base_url, srv.api_key, quiet=True)
        yield srv, client, model
    finally:
        srv.stop()


def test_one_adapter_slot_makes_two_adapters_take_turns(served):
    """``--max-loras 1``: a step runs requests of one adapter only, so 4 + 4 requests of two adapters take at least
    twice the steps of one answer, where 8 of one adapter run side by side."""
    _, client, _ = served
    m = 128  # long enough that requests reaching the engine tens of steps apart (a loaded machine) still overlap
    one = batching.measure(client, lora.send_mixed, client, {"kjv": 8}, m)
    two = batching.measure(client, lora.send_mixed, client, {"kjv": 4, "rv1909": 4}, m)
    for run in (one, two):
        assert run.alone and [r.output_tokens for r in run.result.records] == [m] * 8
    assert m <= one.delta.steps < 2 * m, one.delta
    assert two.delta.steps >= 2 * m, two.delta


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
