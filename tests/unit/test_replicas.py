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
from pathlib import Path

import pytest

from llmlab import replicas
from llmlab.serve.info import write_private
from llmlab.serve.proxy import answers, command, policy, relay, router
from llmlab.serve.proxy import keys as proxy_keys


def test_cores_are_shared_out_in_whole_runs():
    assert replicas.split_cores(2, [0, 1]) == ["0", "1"]
    assert replicas.split_cores(2, [0, 1, 2, 3]) == ["0-1", "2-3"]
    assert replicas.split_cores(1, [0, 1]) == ["0-1"]
    for bad in (0, 3, True, 1.5):
        with pytest.raises(ValueError, match="core of its own"):
            replicas.split_cores(bad, [0, 1])


def test_prefix_key_is_the_salt_and_the_start_of_the_prompt():
    body = lambda **r: json.dumps(r).encode()  # noqa: E731
    assert router.prefix_key(body(prompt="x" * 300, cache_salt="s"), chars=256) == b"s\x00" + b"x" * 256
    assert router.prefix_key(body(prompt=["first", "second"])) == b"\x00first"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert router.prefix_key(body(messages=chat)).startswith(b'\x00[{"role":"system","content":"be brief"}')
    for not_a_prompt in (b"not json", b"[1, 2]", body(model="m"), b"[" * 100_000):
        assert router.prefix_key(not_a_prompt) is None
    assert router.prefix_key(body(prompt="\ud800")) is not None  # a lone surrogate does not stop the proxy
    long_chat = [{"role": "user", "content": f"message {i}"} for i in range(1000)]  # written only as far as needed
    assert router.prefix_key(body(messages=long_chat)) == b"\x00" + json.dumps(long_chat, separators=(",", ":"))[
        :256].encode()


def test_prefix_routing_parses_no_body_over_its_bound():
    """security-review-2, finding 6: a 32 MiB body of empty objects took 900 MB and seconds of the event loop to
    parse; a body over PREFIX_PARSE_MAX is routed least-loaded, unparsed."""
    empty_objects = b'{"messages":[' + b"{}," * (router.PREFIX_PARSE_MAX // 3) + b"{}]}"
    assert len(empty_objects) > router.PREFIX_PARSE_MAX and router.prefix_key(empty_objects) is None
    fits = b'{"messages":[' + b"{}," * (router.PREFIX_PARSE_MAX // 3 - 10) + b"{}]}"
    assert router.prefix_key(fits) == b"\x00[" + b"{}," * 85  # 256 characters


def test_rendezvous_hashing_moves_only_the_keys_a_new_replica_takes():
    keys = [f"course {i}".encode() for i in range(400)]
    two = [router.home_replica(k, 2) for k in keys]
    three = [router.home_replica(k, 3) for k in keys]
    assert 150 < two.count(0) < 250  # spread, not piled on one replica
    moved = [(a, b) for a, b in zip(two, three, strict=True) if a != b]
    assert moved and all(b == 2 for _, b in moved)  # every key that moved went to the new replica
    assert 90 < len(moved) < 180  # about a third of them
    assert replicas.homes(["p"] * 3, ["s"] * 3, 2) == [router.home_replica(b"s\x00p", 2)] * 3


@pytest.fixture
def key_ring(tmp_path):
    write_private(tmp_path / "key", "k" * 32 + "\n")
    return proxy_keys.KeyRing(tmp_path / "key")


def request(body: dict | None = None) -> policy.Request:
    r = policy.Request()
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
    p = relay.Proxy(["unix:/a.sock", "unix:/b.sock"], key_ring)
    a, b = p.replicas
    assert [p.pick(request()) for _ in range(4)] == [a, b, a, b]
    a.in_flight, b.in_flight = 3, 1
    assert p.pick(request()) is b and p.pick(request()) is b


def test_prefix_routing_keeps_a_prompt_home_until_the_balance_runs_out(key_ring):
    p = relay.Proxy(["unix:/a.sock", "unix:/b.sock"], key_ring, route="prefix", balance=4)
    body = {"prompt": "the same system prompt", "cache_salt": "room"}
    home = p.replicas[router.home_replica(router.prefix_key(json.dumps(body).encode()), 2)]
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
        with pytest.raises(answers.ProxyError, match=words):
            relay.Proxy(["unix:/a.sock", "unix:/b.sock"], key_ring, **kwargs)
    with pytest.raises(answers.ProxyError, match="no --upstream"):
        relay.Proxy([], key_ring)
    with pytest.raises(ValueError, match="least-loaded, prefix"):
        replicas.Router(["/a.sock"], route="random")


def test_the_router_refuses_metrics_that_would_be_one_replicas(key_ring):
    r = request()
    r.url, r.headers = b"/metrics", [(b"authorization", b"Bearer " + b"k" * 32)]
    assert relay.Proxy("unix:/a.sock", key_ring).judge(r) is None
    answer = relay.Proxy(["unix:/a.sock", "unix:/b.sock"], key_ring).judge(r)
    assert answer.startswith(b"HTTP/1.1 404") and b"read /metrics from each server" in answer


# -- several models, one endpoint (issue 41): the router picks the model's pool by the request's "model"

def test_named_upstreams_make_one_pool_per_model_each_with_its_own_key(key_ring):
    p = relay.Proxy(["8b=unix:/a.sock", "70b=http://node2:8000", "8b=unix:/b.sock"], key_ring,
                    upstream_keys={"70b": "seventy-key"})
    assert p.by_model and list(p.pools) == ["8b", "70b"] and p.models == "8b, 70b"
    a, big, b = p.replicas
    assert p.pools["8b"] == [a, b] and big.address == ("node2", 8000)
    assert big.auth == b"authorization: Bearer seventy-key\r\n" and a.auth == b.auth == b""
    assert b"seventy-key" in p.upstream_head(request({"model": "70b"}), big)
    assert b"seventy-key" not in p.upstream_head(request({"model": "8b"}), a)  # a key goes to its upstream alone
    assert not relay.Proxy(["unix:/a.sock", "unix:/b.sock"], key_ring).by_model  # replicas of one model, as before


def test_a_request_goes_to_the_replicas_of_the_model_it_names_and_nowhere_else(key_ring):
    p = relay.Proxy(["8b=unix:/a.sock", "8b=unix:/b.sock", "70b=unix:/c.sock"], key_ring)
    a, b, c = p.replicas
    assert [p.pick(request({"model": "8b", "prompt": "hi"})) for _ in range(4)] == [a, b, a, b]  # least-loaded
    c.in_flight = 50  # busy: still the only one that may answer the 70B
    assert all(p.pick(request({"model": "70b", "prompt": "hi"})) is c for _ in range(3))
    assert c.sent == 3 and a.sent == b.sent == 2


def test_prefix_routing_works_inside_a_models_pool(key_ring):
    p = relay.Proxy(["8b=unix:/a.sock", "8b=unix:/b.sock", "70b=unix:/c.sock"], key_ring, route="prefix")
    body = {"model": "8b", "prompt": "the same system prompt"}
    home = p.pools["8b"][router.home_replica(router.prefix_key(json.dumps(body).encode()), 2)]
    assert all(p.pick(request(body)) is home for _ in range(5))
    assert p.pick(request({**body, "model": "70b"})).name == "unix:/c.sock"


def test_an_unknown_or_missing_model_gets_a_sentence_that_names_the_models_served(key_ring):
    p = relay.Proxy(["8b=unix:/a.sock", "70b=unix:/b.sock"], key_ring)
    for body, status, words in (({"model": "405b"}, 404, "The model '405b' is not served here; this server serves "
                                 "8b, 70b (GET /v1/models lists them)"),
                                ({"prompt": "hi"}, 400, 'names none: add \\"model\\": one of them'),
                                ({"model": 8}, 400, "serves several models (8b, 70b)")):
        with pytest.raises(router.Unroutable) as e:
            p.pick(request(body))
        assert e.value.answer.startswith(b"HTTP/1.1 %d" % status) and words.encode() in e.value.answer, e.value.answer
    assert all(r.sent == 0 for r in p.replicas)


def test_model_of_reads_the_model_and_no_large_body_made_of_many_values():
    """security-review-2, finding 6, for a router of several models: a large body is parsed only if it holds few JSON
    values (a long prompt does; a body of a million empty objects does not)."""
    assert router.model_of(json.dumps({"prompt": "x", "model": "8b"}).encode()) == "8b"
    for nameless in (b"not json", b"[1, 2]", b'{"model": null}', b"[" * 100_000):
        assert router.model_of(nameless) is None
    long_prompt = json.dumps({"messages": [{"role": "user", "content": "word " * 400_000}], "model": "70b"}).encode()
    assert len(long_prompt) > router.MODEL_PARSE_MAX and router.model_of(long_prompt) == "70b"
    empty_objects = b'{"model":"8b","messages":[' + b"{}," * (router.MODEL_PARSE_MAX // 3) + b"{}]}"
    with pytest.raises(ValueError, match="more than 65,536 JSON values"):
        router.model_of(empty_objects)


def test_a_body_too_many_values_to_read_the_model_from_is_refused_413(key_ring):
    p = relay.Proxy(["8b=unix:/a.sock", "70b=unix:/b.sock"], key_ring)
    r = policy.Request()
    r.body = bytearray(b'{"model":"8b","prompt":[' + b"1," * (router.MODEL_PARSE_MAX // 2) + b"1]}")
    with pytest.raises(router.Unroutable) as e:
        p.pick(r)
    assert e.value.answer.startswith(b"HTTP/1.1 413") and b"send a shorter request" in e.value.answer


def test_the_model_lists_of_every_upstream_are_merged_into_one():
    listed = lambda *ids: json.dumps({"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}).encode()  # noqa: E731
    merged = router.merge_models([(200, listed("8b")), (200, listed("70b")), (0, b""), (503, b"loading")])
    assert merged == {"object": "list", "data": [{"id": "8b", "object": "model"}, {"id": "70b", "object": "model"}]}
    assert router.merge_models([(0, b""), (200, b"not json"), (200, b'{"data": 3}')]) is None


def test_a_router_of_models_answers_models_and_health_itself_get_only(key_ring):
    p = relay.Proxy(["8b=unix:/a.sock", "70b=unix:/b.sock"], key_ring)
    for path, method, expected in ((b"/v1/models", b"GET", None), (b"/health", b"GET", None),
                                   (b"/v1/models", b"POST", 405), (b"/metrics", b"GET", 404)):
        r = request()
        r.url, r.method, r.headers = path, method, [(b"authorization", b"Bearer " + b"k" * 32)]
        answer = p.judge(r)
        assert (answer is None and r.gather == path.decode()) if expected is None else \
            answer.startswith(b"HTTP/1.1 %d" % expected), (path, method, answer)
    r = request()
    r.url, r.method = b"/v1/models", b"GET"  # no key: 401 before anything, as on every route
    assert p.judge(r).startswith(b"HTTP/1.1 401") and r.gather is None


def test_upstream_specs_and_key_files_are_named_when_wrong(key_ring, tmp_path):
    assert router.split_upstream("meta-llama/Llama-3.1-8B=http://n1:8000") == ("meta-llama/Llama-3.1-8B",
                                                                              "http://n1:8000")
    assert router.split_upstream("unix:/run/a=b/vllm.sock") == (None, "unix:/run/a=b/vllm.sock")
    for bad, words in ((["8b=/a.sock"], "give unix:/path/vllm.sock"), (["8b=unix:/a", "unix:/b"], "or of none")):
        with pytest.raises(answers.ProxyError, match=words):
            relay.Proxy(bad, key_ring)
    with pytest.raises(answers.ProxyError, match="--upstream-key-file for 405b: no --upstream serves that model"):
        relay.Proxy(["8b=unix:/a"], key_ring, upstream_keys={"405b": "k"})
    write_private(tmp_path / "70b.key", "seventy\n")
    write_private(tmp_path / "all.key", "every\n")
    assert command.upstream_keys([f"70b={tmp_path}/70b.key", str(tmp_path / "all.key")], {"8b", "70b"}) == (
        "every", {"70b": "seventy"})
    with pytest.raises(answers.ProxyError, match="Cannot read the upstream key file .*nowhere"):
        command.upstream_keys([f"70b={tmp_path}/nowhere"], {"70b"})
    cmd = command.proxy_command("127.0.0.1:0", {"8b": [Path("/a.sock")], "70b": ["http://n2:8000"]}, Path("/k"),
                              upstream_key_files={"70b": Path("/keys/70b.key")})
    assert " ".join(cmd).count("--upstream ") == 2 and "8b=unix:/a.sock" in cmd and "70b=http://n2:8000" in cmd
    assert cmd[cmd.index("--upstream-key-file") + 1] == "70b=/keys/70b.key"
