"""llmlab.serve.proxy.policy: who may reach vLLM, judged as a function of the request, the keys and a few facts.

Why here, with no engine and no socket: ``judge`` is the one function every request's head goes through (issue 49
gave it a module of its own so that a security reading is one file), so its order and its answers are checked
directly, with a real key ring on real files.  tests/engine/test_proxy.py sends the same cases as raw bytes through
the running proxy.
"""

from __future__ import annotations

import collections
import json

import pytest

from llmlab.serve.info import write_private
from llmlab.serve.proxy import policy
from llmlab.serve.proxy.keys import KeyRing, key_digest_line

OWNER, LEARNER = "owner-key-0123456789abcdef", "learner-key-0123456789abcdef"


@pytest.fixture
def ring(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(key_digest_line(LEARNER) + "\n")
    return KeyRing(write_private(tmp_path / "owner.key", OWNER + "\n"), keys, recheck=0)


def request(path: bytes, key: str | None = None, method: bytes = b"POST") -> policy.Request:
    r = policy.Request()
    r.url, r.method = path, method
    r.headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return r


def status(answer: bytes | None) -> int | None:
    return None if answer is None else int(answer.split(b" ", 2)[1])


def message(answer: bytes) -> str:
    return json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["message"]


def test_a_path_that_is_not_normal_is_refused_before_the_key_is_looked_at(ring):
    for path in (b"/v1/../metrics", b"/v1/%2e%2e/x", b"//v1/models", b"/v1\\models"):
        r = request(path)
        assert status(policy.judge(r, ring, {})) == 400 and not r.last  # no key asked: nothing learned of keys


def test_no_key_or_a_wrong_one_is_401_and_the_connections_last_answer(ring):
    for key in (None, "not-a-key-of-this-server"):
        r = request(b"/v1/completions", key)
        answer = policy.judge(r, ring, {})
        assert status(answer) == 401 and r.last and not r.keyed
        assert "Bearer" in message(answer)


def test_the_allow_list_is_told_only_to_a_key_holder(ring):
    assert status(policy.judge(request(b"/tokenize"), ring, {})) == 401
    assert status(policy.judge(request(b"/tokenize", OWNER), ring, {})) == 404
    closed = policy.judge(request(b"/v1/load_lora_adapter", LEARNER), ring, {})
    assert status(closed) == 403 and "--lora-modules" in message(closed)
    assert status(policy.judge(request(b"/v1/models", LEARNER, b"PUT"), ring, {})) == 405
    ok = request(b"http://example/v1/completions?x=1", LEARNER)
    assert policy.judge(ok, ring, {}) is None and ok.keyed and ok.url == b"/v1/completions?x=1"


def test_a_learners_key_has_a_share_of_requests_in_progress_and_the_owners_none(ring):
    learner = request(b"/v1/completions", LEARNER)
    busy = collections.Counter({ring.learner(f"Bearer {LEARNER}"): policy.KEY_REQUESTS})
    assert status(policy.judge(learner, ring, busy)) == 429 and learner.over
    assert policy.judge(request(b"/v1/completions", OWNER), ring, busy) is None


def test_a_shared_server_salts_each_learners_generations_and_not_the_owners(ring):
    learner, owner = request(b"/v1/completions", LEARNER), request(b"/v1/completions", OWNER)
    assert policy.judge(learner, ring, {}, salted=True) is None and learner.salt
    assert policy.judge(owner, ring, {}, salted=True) is None and owner.salt is None
    unsalted = request(b"/v1/completions", LEARNER)
    assert policy.judge(unsalted, ring, {}, salted=False) is None and unsalted.salt is None


def test_metrics_are_refused_by_a_router_of_several_replicas_and_gathered_paths_marked(ring):
    assert status(policy.judge(request(b"/metrics", OWNER, b"GET"), ring, {}, replicas=2)) == 404
    assert policy.judge(request(b"/metrics", OWNER, b"GET"), ring, {}, replicas=1) is None
    models = request(b"/v1/models", OWNER, b"GET")
    assert policy.judge(models, ring, {}, by_model=True) is None and models.gather == "/v1/models"


@pytest.mark.parametrize("value, ok", [("2", True), ("", True), ("abc", False), ("0", False), ("-5", False)])
def test_the_send_timeout_from_the_environment_is_a_number_of_seconds_or_one_sentence(value, ok):
    """LLMLAB_PROXY_SEND_TIMEOUT (lesson 19 and the tests shorten it): a bad value stops the proxy at its start with
    the variable named, not with Python's float() error or a timer that never waits."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", "from llmlab.serve.proxy import limits; print(limits.SEND_TIMEOUT)"],
                         env={"PATH": "/usr/bin:/bin", "LLMLAB_PROXY_SEND_TIMEOUT": value}, capture_output=True,
                         text=True)
    if ok:
        assert run.returncode == 0 and float(run.stdout) == (float(value) if value else 60.0)
    else:
        assert run.returncode == 1 and f"LLMLAB_PROXY_SEND_TIMEOUT={value!r}: give a number of seconds" in run.stderr
