"""llmlab.replicas and the proxy as a router (notebook 15): how a replica is picked, and the router in front of the
real embedded engine.

Two engines of their own (``Replicas``) and the TP=2 engine are started by the notebook itself, under nbval; here
the router fronts the embedded engine's socket and a socket nobody listens on, which shows every routing decision
in the answers (200 or 503) without starting a second engine.

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/engine/test_replicas.py (the tests that start the real engine).
"""

from __future__ import annotations

import json

import pytest

from llmlab import replicas
from llmlab.serve import proxy
from llmlab.serve.info import write_private


def test_cores_are_shared_out_in_whole_runs():
    assert replicas.split_cores(2, [0, 1]) == ["0", "1"]
    assert replicas.split_cores(2, [0, 1, 2, 3]) == ["0-1", "2-3"]
    assert replicas.split_cores(1, [0, 1]) == ["0-1"]
    for bad in (0, 3, True, 1.5):
        with pytest.raises(ValueError, match="core of its own"):
            replicas.split_cores(bad, [0, 1])


def test_prefix_key_is_the_salt_and_the_start_of_the_prompt():
    body = lambda **r: json.dumps(r).encode()  # noqa: E731
    assert proxy.prefix_key(body(prompt="x" * 300, cache_salt="s"), chars=256) == b"s\x00" + b"x" * 256
    assert proxy.prefix_key(body(prompt=["first", "second"])) == b"\x00first"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert proxy.prefix_key(body(messages=chat)).startswith(b'\x00[{"role":"system","content":"be brief"}')
    for not_a_prompt in (b"not json", b"[1, 2]", body(model="m"), b"[" * 100_000):
        assert proxy.prefix_key(not_a_prompt) is None
    assert proxy.prefix_key(body(prompt="\ud800")) is not None  # a lone surrogate does not stop the proxy
    long_chat = [{"role": "user", "content": f"message {i}"} for i in range(1000)]  # written only as far as needed
    assert proxy.prefix_key(body(messages=long_chat)) == b"\x00" + json.dumps(long_chat, separators=(",", ":"))[
        :256].encode()


def test_prefix_routing_parses_no_body_over_its_bound():
    """security-review-2, finding 6: a 32 MiB body of empty objects took 900 MB and seconds of the event loop to
    parse; a body over PREFIX_PARSE_MAX is routed least-loaded, unparsed."""
    empty_objects = b'{"messages":[' + b"{}," * (proxy.PREFIX_PARSE_MAX // 3) + b"{}]}"
    assert len(empty_objects) > proxy.PREFIX_PARSE_MAX and proxy.prefix_key(empty_objects) is None
    fits = b'{"messages":[' + b"{}," * (proxy.PREFIX_PARSE_MAX // 3 - 10) + b"{}]}"
    assert proxy.prefix_key(fits) == b"\x00[" + b"{}," * 85  # 256 characters


def test_rendezvous_hashing_moves_only_the_keys_a_new_replica_takes():
    keys = [f"course {i}".encode() for i in range(400)]
    two = [proxy.home_replica(k, 2) for k in keys]
    three = [proxy.home_replica(k, 3) for k in keys]
    assert 150 < two.count(0) < 250  # spread, not piled on one replica
    moved = [(a, b) for a, b in zip(two, three, strict=True) if a != b]
    assert moved and all(b == 2 for _, b in moved)  # every key that moved went to the new replica
    assert 90 < len(moved) < 180  # about a third of them
    assert replicas.homes(["p"] * 3, ["s"] * 3, 2) == [proxy.home_replica(b"s\x00p", 2)] * 3


@pytest.fixture
def key_ring(tmp_path):
    write_private(tmp_path / "key", "k" * 32 + "\n")
    return proxy.KeyRing(tmp_path / "key")


def request(body: dict | None = None) -> proxy.Request:
    r = proxy.Request()
    r.body = bytearray(json.dumps(body or {}).encode())
    return r


def test_the_committed_h200_runs_compare_the_same_load_and_count_every_request():
    """benchmarks/results/h200x2-llama3.1-8b-replicas-vs-tp2 (notebook 15, section 5): both runs measured both layouts
    at the same levels, every request of the benchmark reached a replica (dealt evenly), and the logged KV tokens
    are the log excerpts'."""
    from llmlab.rehearse import LOG_EXCERPT, parse_memory_log

    runs = replicas.gpu_runs()
    assert list(runs) == ["run1", "run2"]
    table = replicas.gpu_table(runs)
    assert list(table.index) == [1, 8, 64, 128, 256]
    assert table.notna().all().all() and (table["output tok/s"] > 0).all().all()
    for run, layouts in runs.items():
        sweep = layouts["2 replicas"]["sweep"]
        # rehearsal.benchmark: 2 warm-ups, 5 at batch 1, then per level 1 warm-up and the level's requests
        sent = 2 + 5 + sum(1 + s["requests"] for s in sweep)
        assert all(s["ok"] == s["requests"] for s in sweep)
        dealt = layouts["2 replicas"]["requests_per_replica"]
        assert sum(dealt) == sent and abs(dealt[0] - dealt[1]) <= 1, (run, dealt)
        for folder, mem in (("replica-0", layouts["2 replicas"]["memory"][0]), ("tp-2", layouts["TP=2"]["memory"])):
            excerpt = replicas.GPU_RESULTS / run / folder / LOG_EXCERPT
            assert parse_memory_log(excerpt.read_text()).kv_tokens == mem["kv_tokens"], (run, folder)
    memory = replicas.gpu_memory(runs)
    assert memory.loc["TP=2", "KV tokens in all"] > memory.loc["2 replicas", "KV tokens in all"]
    assert memory.loc["2 replicas", "one request's pool"] * 2 == memory.loc["2 replicas", "KV tokens in all"]


def test_least_loaded_takes_the_idlest_and_takes_turns_when_idle(key_ring):
    p = proxy.Proxy(["unix:/a.sock", "unix:/b.sock"], key_ring)
    a, b = p.replicas
    assert [p.pick(request()) for _ in range(4)] == [a, b, a, b]
    a.in_flight, b.in_flight = 3, 1
    assert p.pick(request()) is b and p.pick(request()) is b


def test_prefix_routing_keeps_a_prompt_home_until_the_balance_runs_out(key_ring):
    p = proxy.Proxy(["unix:/a.sock", "unix:/b.sock"], key_ring, route="prefix", balance=4)
    body = {"prompt": "the same system prompt", "cache_salt": "room"}
    home = p.replicas[proxy.home_replica(proxy.prefix_key(json.dumps(body).encode()), 2)]
    other = next(r for r in p.replicas if r is not home)
    home.in_flight = 3
    assert all(p.pick(request(body)) is home for _ in range(5))
    home.in_flight = 4  # four more in flight than the other replica: the valve opens
    assert p.pick(request(body)) is other
    home.in_flight = 0
    assert {p.pick(request({"prompt": f"learner {i}"})).name for i in range(40)} == {"unix:/a.sock", "unix:/b.sock"}


def test_bad_router_settings_are_named(key_ring):
    for kwargs, words in (({"route": "random"}, "--route 'random'"), ({"balance": 0}, "--balance 0"),
                          ({"prefix_chars": 0}, "--prefix-chars 0")):
        with pytest.raises(proxy.ProxyError, match=words):
            proxy.Proxy(["unix:/a.sock", "unix:/b.sock"], key_ring, **kwargs)
    with pytest.raises(proxy.ProxyError, match="no --upstream"):
        proxy.Proxy([], key_ring)
    with pytest.raises(ValueError, match="least-loaded, prefix"):
        replicas.Router(["/a.sock"], route="random")


def test_the_router_refuses_metrics_that_would_be_one_replicas(key_ring):
    r = request()
    r.url, r.headers = b"/metrics", [(b"authorization", b"Bearer " + b"k" * 32)]
    assert proxy.Proxy("unix:/a.sock", key_ring).judge(r) is None
    answer = proxy.Proxy(["unix:/a.sock", "unix:/b.sock"], key_ring).judge(r)
    assert answer.startswith(b"HTTP/1.1 404") and b"read /metrics from each server" in answer
