"""vLLM's recipe in one place (issue #35): ``llmlab.serve.vllm`` builds the argv, the environment and the start-up
phases that the embedded server, the SLURM launcher, rehearsals and the offline engine all use.

Why these tests: four environment recipes, two phase tables and two copies of the CPU flags drifted apart once;
these check that every path reads the one recipe (same keys, same values), that the recipe's names are written in
one module only, and that flags are set by name without disturbing the rest of an argv.  Pure: no engine starts.
"""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path

import pytest

from llmlab import cluster, memory, offline
from llmlab.ops import generate, rehearsal
from llmlab.serve import vllm
from llmlab.serve.embedded import EmbeddedServer
from llmlab.serve.proc import pid_alive
from llmlab.serve.proxy.command import proxy_command

PACKAGE = Path(vllm.__file__).resolve().parent.parent
CPU_JOB = "llmlab-tiny-cpu"
RECIPE = ["VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "VLLM_RPC_BASE_PATH", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE",
          "TRANSFORMERS_OFFLINE"]


def render(name: str, **env) -> cluster.RenderedJob:
    job = cluster.job_settings(name) if isinstance(name, str) else name
    return cluster.render(job, job_id="7", port=4000, python="/py",
                          env={"TMPDIR": "/t", "LLMLAB_HOME": "/h", "LLMLAB_RAY_VERSION": "2.60",
                                "LLMLAB_RAY_HEAD_IP": "10.0.0.1", **env})


# --- the environment ------------------------------------------------------------------------------------------

def test_the_launcher_and_the_embedded_server_give_vllm_the_same_recipe():
    rendered = render(CPU_JOB)
    run_dir = "/t/llmlab-run-7"
    assert list(rendered.env)[:6] == RECIPE  # the job script exports them in this order
    assert {k: rendered.env[k] for k in RECIPE} == {
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_RPC_BASE_PATH": run_dir,
        "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    embedded = vllm.engine_env(Path(run_dir), 1)
    assert {k: embedded[k] for k in RECIPE} == {k: rendered.env[k] for k in RECIPE}
    assert "VLLM_API_KEY" not in rendered.env


def test_an_unpinned_one_rank_cpu_engine_keeps_its_worker_in_the_engine_core(monkeypatch):
    """unbound_cpu_env: the embedded server and a one-rank CPU job start one process less (the worker inside the
    engine core) on one OpenMP thread; cores pinned by VLLM_CPU_OMP_THREADS_BIND keep vLLM's own mp worker."""
    monkeypatch.delenv(vllm.BIND, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    one = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    assert {k: vllm.engine_env(Path("/run"), 1).get(k) for k in one} == one
    assert {k: render(CPU_JOB).env.get(k) for k in one} == one
    pinned = vllm.engine_env(Path("/run"), 1, overrides={vllm.BIND: "0|1"})
    assert pinned[vllm.BIND] == "0|1" and not set(one) & set(pinned)
    assert not set(one) & set(render(CPU_JOB, VLLM_CPU_OMP_THREADS_BIND="0").env)
    for ranks in (["--tensor-parallel-size", "2"], ["-pp=2"]):  # several ranks: vLLM's mp workers
        assert not set(one) & set(vllm.engine_env(Path("/run"), 1, extra_args=ranks))
    assert not set(one) & set(render(CPU_JOB, LLMLAB_EXTRA_VLLM_ARGS="-tp 2").env)
    assert not set(one) & set(render("llama3.1-8b").env)  # GPUs: vLLM's defaults
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's own choice stands
    assert vllm.engine_env(Path("/run"), 1)["OMP_NUM_THREADS"] == "4"


def test_a_gpu_job_gets_the_recipe_without_the_cpu_space_or_offline_hub():
    env = render("llama3.1-8b").env
    assert list(env)[:3] == RECIPE[:3] and env["VLLM_RPC_BASE_PATH"] == "/t/llmlab-run-7"
    assert not {"VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"} & set(env)


def test_a_rehearsal_gets_the_recipe_with_its_sockets_beside_vllms(tmp_path):
    job = rehearsal.rehearsal_job(memory.TINY_NAME, engine="cpu")
    _, env, _ = rehearsal.serve_argv(job, tmp_path / "model", 0, uds=tmp_path / "vllm.sock")
    assert env == {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_RPC_BASE_PATH": str(tmp_path),
                   "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    _, tcp_env, _ = rehearsal.serve_argv(job, tmp_path / "model", 8123)
    assert "VLLM_RPC_BASE_PATH" not in tcp_env  # no private folder to put them in


def test_a_gpu_without_flashinfer_turns_its_sampler_off_and_only_there():
    assert vllm.vllm_env("gpu", flashinfer=False)["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in vllm.vllm_env("gpu") | vllm.vllm_env("cpu", flashinfer=False)
    with pytest.raises(ValueError, match="platform='tpu'"):
        vllm.vllm_env("tpu")


def test_the_offline_engine_adds_only_what_an_in_process_engine_needs(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    env = offline.engine_environment(2, "cpu")
    recipe = vllm.vllm_env("cpu", kv_cache_gib=2)
    assert {k: env[k] for k in recipe} == recipe
    assert {k: env[k] for k in set(env) - set(recipe)} == {
        "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "INFO", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert "VLLM_CPU_KVCACHE_SPACE" not in offline.engine_environment(2, "gpu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the learner's explicit choice stands
    assert offline.engine_environment(1, "gpu")["HF_HUB_OFFLINE"] == "0"
    assert offline.engine_environment(1, "gpu")["TRANSFORMERS_OFFLINE"] == "0"


def test_a_local_vllm_gets_this_environment_without_a_key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "the-users-own-ray-token")  # Ray would take it before any token file
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    monkeypatch.setenv("LLMLAB_RECIPE_TEST", "kept")
    for name in vllm.INHERITED_OPENERS:  # security-review-3 F10: the shell does not reopen runtime LoRA
        monkeypatch.setenv(name, "1")
    for env in (vllm.engine_env(Path("/run"), 1), generate.offline_engine_env(1, "cpu")):
        assert "VLLM_API_KEY" not in env and "RAY_AUTH_TOKEN" not in env
        assert not set(vllm.INHERITED_OPENERS) & set(env)
        assert (env["VLLM_LOGGING_LEVEL"], env["LLMLAB_RECIPE_TEST"]) == ("DEBUG", "kept")
    assert generate.offline_engine_env(1, "cpu")["PYTHONUNBUFFERED"] == "1"


@pytest.mark.parametrize("gib", [1.5, 0, -1, True])
def test_a_cpu_kv_space_vllm_cannot_read_fails_with_one_sentence_everywhere(gib):
    for make in (vllm.cpu_kv_space, lambda g: vllm.vllm_env("cpu", kv_cache_gib=g), memory.embedded_kv_capacity,
                 lambda g: EmbeddedServer(kv_cache_gib=g), lambda g: offline.engine_environment(g, "cpu"),
                 lambda g: generate.OfflineEngine(kv_cache_gib=g)):
        with pytest.raises(ValueError, match=r"whole number of GiB: use 1, 2, \.\.\."):
            make(gib)
    assert [vllm.cpu_kv_space(g) for g in (1, 2.0, 16)] == ["1", "2", "16"]  # "2.0" would fail vLLM's int()


def test_a_cpu_job_whose_kv_space_vllm_cannot_read_is_refused_with_its_table(tmp_path):
    settings = tmp_path / "models.toml"
    settings.write_text('["cpu"]\nmodel = "llmlab-tiny"\nnodes = 1\ngpus_per_node = 0\ntp = 1\npp = 1\nengine = "cpu"\n'
                        'kv_cache_gib = 1.5\n')
    with pytest.raises(cluster.SettingsError, match=r"models.toml \[cpu\]: kv_cache_gib=1.5: .*whole number of GiB"):
        cluster.load_settings(settings)


# Every other vLLM variable the package sets: named once, in llmlab.serve.vllm (architecture-review-3, 5.2 item 3:
# the offline engine wrote two of them itself, under the opposite rationale, and nothing watched them).
ALSO_SET = {"VLLM_USE_FLASHINFER_SAMPLER", "--enable-prefix-caching", "VLLM_LOGGING_LEVEL",
            "VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS", "VLLM_CACHE_ROOT", "VLLM_HOST_IP"}


def recipe_names_in(path: Path) -> set[str]:
    """The recipe's variable and flag names that ``path`` spells out as strings or keyword arguments."""
    names = set(RECIPE) | ALSO_SET
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value in names:
            found.add(node.value)
        elif isinstance(node, ast.keyword) and node.arg in names:
            found.add(node.arg)
    return found


def test_the_recipe_is_written_in_one_module():
    """Only llmlab.serve.vllm spells the recipe and every other vLLM variable the package sets; the offline engine
    names the two Hugging Face variables it reads back from this process (an explicit HF_HUB_OFFLINE=0 stands)."""
    spelled = {str(p.relative_to(PACKAGE)): names for p in PACKAGE.rglob("*.py") if (names := recipe_names_in(p))}
    assert spelled == {"serve/vllm.py": set(RECIPE) | ALSO_SET,
                       "offline.py": {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"}}


# --- the flags --------------------------------------------------------------------------------------------------

def test_the_cpu_flags_are_one_list_for_the_embedded_server_and_a_cpu_job(tmp_path):
    job = cluster.job_settings(CPU_JOB)
    assert cluster.vllm_flags(job) == vllm.cpu_flags() == ["--dtype", "float32", "--enable-prefix-caching",
                                                           "--enforce-eager", "--enable-prompt-tokens-details"]
    assert cluster.vllm_flags(dataclasses.replace(job, max_model_len=512)) == [*vllm.cpu_flags(), "--max-model-len",
                                                                              "512"]
    argv = vllm.engine_command(tmp_path, "tiny", tmp_path / "s", 512, ["--seed", "1"])
    assert argv[argv.index("--dtype"):-4] == vllm.cpu_flags(512)
    assert argv[-4:] == ["--distributed-executor-backend", "uni", "--seed", "1"]
    line = render(CPU_JOB, LLMLAB_MAX_MODEL_LEN="512").argv
    assert [line.count(f) for f in ("--dtype", "--enable-prefix-caching", "--max-model-len")] == [1, 1, 1]


def test_set_flag_replaces_by_name_and_keeps_the_rest_of_the_argv():
    argv = ["--tp", "2", "--backend", "ray", "--enforce-eager", "--seed", "1"]
    assert vllm.set_flag(argv, "--backend", "mp") == ["--tp", "2", "--backend", "mp", "--enforce-eager", "--seed", "1"]
    assert argv[3] == "ray"  # a copy: the caller's list stays as it was
    assert vllm.set_flag(argv, "--nnodes", "2") == [*argv, "--nnodes", "2"]
    assert vllm.set_flag(["--backend=ray", "--x", "1"], "--backend", "mp") == ["--backend=mp", "--x", "1"]
    assert vllm.set_flag(["--backend", "a", "--backend", "b"], "--backend", "c") == ["--backend", "a", "--backend", "c"]
    with pytest.raises(ValueError, match="--enforce-eager has no value"):
        vllm.set_flag(argv, "--enforce-eager", "1")


def test_drop_flag_removes_the_flag_and_its_value_only():
    argv = ["--a", "1", "--uds", "/s", "--b", "--uds=/t"]
    assert vllm.drop_flag(argv, "--uds") == ["--a", "1", "--b"]
    assert vllm.drop_flag(argv, "--c") == argv and vllm.drop_flag(argv, "--c") is not argv


def test_a_jobs_executor_across_nodes_is_set_where_the_planner_put_it():
    pp = cluster.job_settings("llama3.1-405b")  # PP=2 over 2 nodes: the planner names Ray itself
    planned, _ = memory.serve_args(pp.model, tp=pp.tp, pp=pp.pp, max_model_len=pp.context, dtype=pp.dtype,
                                   gpu_memory_utilization=pp.gpu_memory_utilization)
    mp = cluster.vllm_flags(dataclasses.replace(pp, backend="mp"))
    i = planned.index("--distributed-executor-backend") - 3
    assert mp[:i + 2] == [*planned[3:3 + i + 1], "mp"] and mp[-2:] == ["--nnodes", "2"]
    assert cluster.vllm_flags(pp) == planned[3:] + vllm.REPORTING_FLAGS
    tp16 = cluster.vllm_flags(cluster.job_settings("llama3.1-405b-tp16"))  # TP alone across nodes: appended
    assert tp16[-2:] == ["--distributed-executor-backend", "ray"] and tp16.count("--distributed-executor-backend") == 1


def test_the_planners_line_is_its_argv_joined():
    argv, notes = memory.serve_args("llama3.1-70b", tp=4, pp=2, dtype="fp8")
    assert memory.serve_command("llama3.1-70b", tp=4, pp=2, dtype="fp8") == (" ".join(argv), notes)
    assert argv[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-70B-Instruct"] and "--quantization" in argv


def test_a_headless_node_runs_the_heads_flags_without_its_socket_and_with_its_rank():
    job = dataclasses.replace(cluster.job_settings("llama3.1-405b"), backend="mp")
    rendered = render(job)
    worker = rendered.worker_argv(1)
    head = rendered.flags
    assert worker[:5] == ["/py", "-m", "vllm.entrypoints.cli.main", "serve", rendered.model_path]
    expected = vllm.set_flag(vllm.drop_flag(head, "--uds"), "--node-rank", "1")
    assert worker[5:] == [*expected, "--headless"] and head[head.index("--node-rank") + 1] == "0"


def test_a_rehearsal_on_one_node_runs_pp_with_vllms_own_processes_and_the_jobs_line(tmp_path):
    job = rehearsal.rehearsal_job("llama3.1-405b", tp=4, pp=2)
    argv, _, line = rehearsal.serve_argv(job, tmp_path, 8123)
    flags = cluster.vllm_flags(job)
    assert argv[5:5 + len(flags)] == vllm.set_flag(flags, "--distributed-executor-backend", "mp")
    assert line == vllm.serve_line(tmp_path, argv[5:]) and line.startswith(f"vllm serve {tmp_path} --tensor")



@pytest.mark.parametrize("name", ["llama3.1-70b", "llama3.1-405b", "llama3.1-405b-fp8"])
def test_one_function_assembles_a_gpu_jobs_serve_flags_for_the_job_script_and_the_rehearsal(name, tmp_path):
    """cluster.job_flags is the one assembly (architecture-review-3, 5.2 item 3): the job script's flags are it
    with the launcher's socket and LLMLAB_EXTRA_VLLM_ARGS, a rehearsal's with its own socket and dummy weights."""
    job = cluster.job_settings(name)
    rendered = render(job, LLMLAB_EXTRA_VLLM_ARGS="--seed 7")
    assert rendered.flags[:len(cluster.job_flags(job, ["--uds", rendered.uds], ["--seed", "7"]))] == \
        cluster.job_flags(job, ["--uds", rendered.uds], ["--seed", "7"])
    uds = tmp_path / "vllm.sock"
    argv, _, _ = rehearsal.serve_argv(job, tmp_path, 0, uds=uds)
    assert argv[5:] == cluster.job_flags(job, ["--uds", str(uds)], ["--load-format", "dummy"], backend="mp")
    assert cluster.vllm_flags(job)[:2] == memory.serve_flags(job.model, tp=job.tp, pp=job.pp)[0][:2]

# --- the start-up phases ----------------------------------------------------------------------------------------

def test_the_offline_engine_reads_vllms_phase_table_between_two_lines_of_its_own(tmp_path):
    labels = [label for _, label in generate.PHASES]
    assert labels == ["importing vLLM", *(label for _, label in vllm.PHASES), "pre-warming"]
    log = tmp_path / "offline.log"
    steps = [("$ vllm.LLM(model='tiny')\n", "starting Python"), ("llmlab: importing vLLM\n", "importing vLLM"),
             ("INFO [default_loader.py:1] Loading weights took 0.02 seconds\n", "weights loaded, warming up"),
             ("INFO [kv_cache_utils.py:1] CPU KV cache size: 524,288 tokens\n", "KV cache allocated"),
             ("llmlab: pre-warm\n", "pre-warming")]
    text = ""
    for line, expected in steps:
        text += line
        log.write_text(text)
        assert generate.phase(log) == expected, line
    assert vllm.phase(log) == "KV cache allocated"  # the server's table has no lines of llmlab's worker


# --- the processes ----------------------------------------------------------------------------------------------

def test_the_proxy_command_carries_the_routers_options():
    base = proxy_command("127.0.0.1:0", [Path("/a"), Path("/b")], Path("/k"), route="prefix")
    assert not {"--balance", "--prefix-chars", "--watch-pid"} & set(base)
    full = proxy_command("127.0.0.1:0", [Path("/a"), Path("/b")], Path("/k"), route="prefix", balance=3,
                         prefix_chars=10, watch_pid=42)
    assert full == [*base, "--balance", "3", "--prefix-chars", "10", "--watch-pid", "42"]


def test_the_router_runs_as_one_process_group_and_leaves_nothing(tmp_path, monkeypatch):
    from llmlab.replicas import Router

    monkeypatch.setenv("LLMLAB_HOME", str(tmp_path))
    router = Router([tmp_path / "a.sock", tmp_path / "b.sock"], "prefix", balance=3, prefix_chars=10).start()
    try:
        args = router.proc.args
        assert args[args.index("--watch-pid") + 1] == str(os.getpid()) and router.port > 0
        assert os.getpgid(router.proc.pid) == router.proc.pid and router.api_key not in " ".join(args)
    finally:
        router.stop()
    assert not pid_alive(router.proc.pid) and not router.run_dir.exists()
