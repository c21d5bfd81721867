"""llmlab.replicas and the proxy as a router (notebook 15): how a replica is picked, and the router in front of the
real embedded engine.

Two engines of their own (``Replicas``) and the TP=2 engine are started by the notebook itself, under nbval; here
the router fronts the embedded engine's socket and a socket nobody listens on, which shows every routing decision
in the answers (200 or 503) without starting a second engine.

This file holds the tests that start the real engine (or need root); the rest are in tests/unit/test_replicas.py
(the pure tests).
"""

from __future__ import annotations

import httpx
import openai
import pytest

import llmlab
from llmlab import replicas
from llmlab.serve.proc import pid_alive


@pytest.fixture(scope="module")
def half_dead(embedded, tmp_path_factory):
    """A router in front of the embedded engine (replica 0) and of a socket nobody listens on (replica 1)."""
    dead = tmp_path_factory.mktemp("dead") / "vllm.sock"
    routers = {}

    def start(route: str) -> replicas.Router:
        if route not in routers:
            routers[route] = replicas.Router([embedded.extra["uds"], dead], route).start()
        return routers[route]

    yield start
    for router in routers.values():
        router.stop()
        assert not pid_alive(router.proc.pid) and not router.key_file.exists()


@pytest.mark.server
def test_the_router_checks_its_own_key_on_every_route(half_dead, api_key):
    router = half_dead("least-loaded")
    root = router.base_url.removesuffix("/v1")
    for path in ("/v1/models", "/health", "/metrics", "/tokenize", "/v1/../tokenize"):
        assert httpx.get(root + path).status_code in (400, 401), path
    assert httpx.get(f"{root}/v1/models", headers={"Authorization": f"Bearer {api_key}"}).status_code == 401
    assert router.key_file.stat().st_mode & 0o777 == 0o600 and router.api_key not in " ".join(router.proc.args)


@pytest.mark.server
def test_least_loaded_deals_requests_in_turn_and_a_dead_replica_gets_a_sentence(half_dead, embedded):
    router = half_dead("least-loaded")
    client, model = llmlab.connect(router.base_url, router.api_key, quiet=True)
    answers = []
    for _ in range(4):
        try:
            answers.append(client.with_options(max_retries=0).completions.create(
                model=embedded.model, prompt="In the beginning", max_tokens=4, temperature=0).choices[0].text)
        except openai.APIStatusError as e:
            answers.append(e.status_code)
            assert "does not answer" in e.message
    # connect() asked /v1/models once already, so the turns may start at either replica: they alternate
    assert answers[0] == answers[2] and answers[1] == answers[3], answers
    assert sorted(map(type, answers[:2]), key=str) == [int, str] and 503 in answers, answers


@pytest.mark.server
def test_prefix_routing_sends_a_prompt_to_its_home_every_time(half_dead, embedded):
    router = half_dead("prefix")
    headers = {"Authorization": f"Bearer {router.api_key}"}
    prompts = ("In the beginning", "The LORD is my shepherd", "And the king said", "Blessed are the poor")
    assert set(replicas.homes(list(prompts), [""] * 4, 2)) == {0, 1}  # both replicas are somebody's home
    for prompt in prompts:
        home = replicas.homes([prompt], [""], 2)[0]
        codes = {httpx.post(f"{router.base_url}/completions", headers=headers, timeout=30,
                            json={"model": embedded.model, "prompt": prompt, "max_tokens": 2}).status_code
                 for _ in range(3)}
        assert codes == ({200} if home == 0 else {503}), prompt
