"""llmlab.replicas and the proxy as a router (notebook 15): how a replica is picked, and the router in front of the
real embedded engine.

Two engines of their own (``Replicas``) and the TP=2 engine are started by the notebook itself, under nbval; here
the router fronts the embedded engine's socket and a socket nobody listens on, which shows every routing decision
in the answers (200 or 503) without starting a second engine.

This file holds the tests that start the real engine (or need root); the rest are in tests/unit/test_replicas.py
(the pure tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

import llmlab
from llmlab import engines, replicas
from llmlab.serve.info import ServerInfo
from llmlab.serve.metrics import fetch_metrics, read_counters
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


# -- several models, one endpoint (issue 41)

@pytest.fixture(scope="module")
def two_models(embedded):
    """The day before a workshop, on two cores: the session's tiny model and an engine of the draft model, each behind
    its own key-checking proxy with its own key, and one router in front of both proxies (``http://``, each with that
    server's key file), as a router fronts the 8B's and the 70B's jobs."""
    draft = engines.start(model=engines.DRAFT_MODEL, progress=False)
    router = None
    try:
        router = replicas.Router({embedded.model: [f"http://127.0.0.1:{embedded.port}"],
                                  draft.name: [f"http://127.0.0.1:{draft.port}"]},
                                 upstream_key_files={embedded.model: Path(embedded.api_key_file),
                                                     draft.name: draft.key_file}).start()
        yield router, embedded, draft
    finally:
        if router is not None:
            router.stop()
        draft.stop()


def _finished(servers) -> list[float]:
    """Each engine's count of finished requests, read from the engine itself (its own /metrics, its own key)."""
    return [read_counters(fetch_metrics(base_url, key)).finished for base_url, key in servers]


@pytest.mark.server
def test_one_router_serves_two_models_each_from_its_own_engine_and_no_other(two_models, api_key):
    router, tiny, draft = two_models
    root, headers = router.base_url.removesuffix("/v1"), {"Authorization": f"Bearer {router.api_key}"}
    for path in ("/v1/models", "/health", "/metrics", "/tokenize", "/v1/completions"):  # no key: 401, every route
        assert httpx.get(root + path).status_code == 401, path
        assert httpx.post(root + path, json={"model": tiny.model, "prompt": "x"}).status_code == 401, path
    for engine_key in (api_key, draft.api_key):  # an engine's own key is not the router's
        assert httpx.get(f"{root}/v1/models", headers={"Authorization": f"Bearer {engine_key}"}).status_code == 401

    listed = httpx.get(f"{router.base_url}/models", headers=headers)
    assert sorted(m["id"] for m in listed.json()["data"]) == sorted([tiny.model, draft.name])
    assert httpx.get(f"{root}/health", headers=headers).status_code == 200
    client, _ = llmlab.connect(router.base_url, router.api_key, quiet=True)
    engines_ = [(tiny.base_url, api_key), (draft.base_url, draft.api_key)]
    before = _finished(engines_)
    answers = {}
    for model, n in ((tiny.model, 3), (draft.name, 2)):
        for _ in range(n):
            done = client.completions.create(model=model, prompt="In the beginning", max_tokens=4, temperature=0)
            assert done.model == model
            answers.setdefault(model, set()).add(done.choices[0].text)
    deadline = time.monotonic() + 30  # vLLM counts a request just after it answered
    while (counted := [a - b for a, b in zip(_finished(engines_), before, strict=True)]) != [3, 2]:
        assert time.monotonic() < deadline and counted[0] <= 3 and counted[1] <= 2, counted
        time.sleep(0.1)
    assert all(len(texts) == 1 for texts in answers.values()), answers  # greedy: each model answered alike

    with pytest.raises(openai.NotFoundError) as unknown:
        client.with_options(max_retries=0).completions.create(model="llama3.1-70b", prompt="x", max_tokens=2)
    assert "'llama3.1-70b' is not served here" in unknown.value.message
    assert tiny.model in unknown.value.message and draft.name in unknown.value.message
    assert httpx.get(f"{root}/metrics", headers=headers).status_code == 404  # each engine counts its own


@pytest.mark.server
def test_no_engine_key_reaches_a_client_or_the_routers_command_line(two_models, api_key):
    router, tiny, draft = two_models
    headers = {"Authorization": f"Bearer {router.api_key}"}
    seen = [httpx.get(f"{router.base_url}/models", headers=headers),
            httpx.post(f"{router.base_url}/completions", headers=headers, json={"model": draft.name, "prompt": "x",
                                                                               "max_tokens": 2}),
            httpx.post(f"{router.base_url}/completions", headers=headers, json={"model": "nope", "prompt": "x"}),
            httpx.get(router.base_url.removesuffix("/v1") + "/health", headers=headers)]
    assert [r.status_code for r in seen] == [200, 200, 404, 200]
    for key in (api_key, draft.api_key):
        assert not any(key in r.text or key in str(r.headers) for r in seen)
        assert key not in " ".join(router.proc.args)  # key files only


@pytest.mark.server
def test_the_front_job_routes_to_the_models_jobs_once_each_is_ready(two_models, api_key, tmp_path):
    """``python -m llmlab.ops.front``, what the front job of ``llmlab launch A B`` runs, with the two engines standing
    in for two models' jobs (their connection files written as a job's launcher writes them), in a home of its own."""
    _, tiny, draft = two_models
    home = tmp_path / "home"
    (home / "servers").mkdir(parents=True)
    jobs_ = {"201": (tiny.model, tiny.port, tiny.api_key_file), "202": (draft.name, draft.port, draft.key_file)}

    def publish(job_id, status):
        model, port, key_file = jobs_[job_id]
        ServerInfo(kind="slurm", host="127.0.0.1", port=port, model=model, api_key_file=str(key_file), job_id=job_id,
                   status=status, extra={"phase": "loading weights"}).write(home / "servers" / f"job-{job_id}.json")

    publish("201", "ready")
    publish("202", "loading")
    env = {**os.environ, "LLMLAB_HOME": str(home), "SLURM_JOB_ID": "203", "LLMLAB_BIND_HOST": "127.0.0.1",
           "LLMLAB_ADVERTISE_HOST": "127.0.0.1"}
    conn = home / "servers" / "job-203.json"
    with open(tmp_path / "front.out", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "llmlab.ops.front", "--job", "201", "--job", "202",
                                 "--poll", "0.2"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "waiting for job 202" not in ((ServerInfo.read(conn).extra.get("phase") if conn.exists() else "") or ""):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "front.out").read_text()
            time.sleep(0.1)
        publish("202", "ready")
        while not conn.exists() or ServerInfo.read(conn).status != "ready":
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "front.out").read_text()
            time.sleep(0.1)
        info = ServerInfo.read(conn)
        assert info.extra["models"] == [tiny.model, draft.name] and info.model == tiny.model
        client, _ = llmlab.connect(info.base_url, info.key(), quiet=True)
        assert sorted(m.id for m in client.models.list().data) == sorted([tiny.model, draft.name])
        done = client.completions.create(model=draft.name, prompt="In the beginning", max_tokens=2, temperature=0)
        assert done.model == draft.name
        key_file = Path(info.api_key_file)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert not conn.exists() and not key_file.exists() and (home / "servers" / "job-203.ended").exists()
    assert "READY: llmlab-tiny, llmlab-tiny-draft at http://127.0.0.1:" in (tmp_path / "front.out").read_text()
