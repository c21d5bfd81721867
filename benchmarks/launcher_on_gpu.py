"""The SLURM launcher's GPU path, end to end, on a GPU machine that has no SLURM (the course's lent H100).

Why: ``llmlab rehearse`` starts vLLM by itself; this drives the *launcher* (``slurm/llmlab-serve.sh``) that a
cluster job runs, unchanged: the rendered ``vllm serve`` line on a private Unix socket, the key file, the
key-checking proxy, the readiness wait with its progress lines, the connection file, and the clean-up on
SIGTERM.  Then a notebook's ``llmlab.connect()`` finds that server through the connection file and sends a
completion and a streamed chat through the proxy; ``llmlab.ops.jobs.metrics`` reads its ``/metrics``; a load sweep
measures it; SIGTERM (what ``scancel`` sends) must leave no vLLM, proxy or Ray process, key or connection file.

What differs from a SLURM job, and only this: there is no slurmctld here, so the launcher's bash runs as a plain
child of this script with ``SLURM_JOB_ID`` and the node name set as sbatch would set them, and the answer of
``scontrol show job`` that ``llmlab.ops.jobs.status`` reads is supplied by this script (RUNNING while the launcher's
process lives, COMPLETED after).  Everything else is llmlab's own code reading the real GPU engine's log.

A job of several nodes (``--nodes 2 --gpus-per-node 1 --tp 1 --pp 2``) plays its nodes on this one host: the
launcher's ``srun -w NODE`` is ``benchmarks/onehost/srun``, which runs the step here with only that node's GPUs
visible (``CUDA_VISIBLE_DEVICES``), so Ray's head and worker are two Ray nodes of one GPU each on 127.0.0.1, and
vLLM's pipeline stages talk over NCCL between them as between two nodes (over NVLink, not InfiniBand).

    python benchmarks/launcher_on_gpu.py llama3.1-8b --out /tmp/out [--concurrency 1 8 64]
    python benchmarks/launcher_on_gpu.py llama3.1-8b --nodes 2 --gpus-per-node 1 --tp 1 --pp 2 --out /tmp/pp2
    python benchmarks/launcher_on_gpu.py --regenerate benchmarks/results/h200x2-llama3.1-8b-launch

Writes ``launch.json`` (every state seen with its time, the answers, the figures) and the job's logs, plus a
snapshot of the launcher output and vLLM log at each change of state (``states/``): the parser fixtures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmlab import cluster, rehearse  # noqa: E402
from llmlab.ops import jobs, rehearsal  # noqa: E402


def processes(pattern: str) -> list[str]:
    """Command lines of live processes matching ``pattern`` (pgrep -af), this script excluded."""
    out = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if str(os.getpid()) != line.split()[0] and "pgrep" not in line]


def kv_layout(job) -> rehearse.Layout:
    """What the KV arithmetic needs of a job (``cluster.job_settings``)."""
    return rehearse.Layout(job.model, job.tp, job.pp, job.context, job.gpu_memory_utilization, job.dtype,
                           job.kv_dtype, job.engine, job.kv_cache_gib)


def launch_logs(result: Path) -> str:
    """The vLLM logs a committed ``launch-TAG.json`` was measured from, beside it: ``vllm-TAG.log`` (the head's),
    then ``vllm-worker-TAG.log`` (the other node's, with backend mp)."""
    tag = result.stem.removeprefix("launch-")
    logs = [result.with_name(f"vllm-{tag}.log"), result.with_name(f"vllm-worker-{tag}.log")]
    return "".join(p.read_text(errors="replace") for p in logs if p.is_file())


def regenerate(folder: Path) -> None:
    """Re-derive every ``launch-*.json``'s ``memory_log`` and ``kv_tokens`` in ``folder`` from its logs, with
    today's parser (``tests/unit/test_rehearse.py`` fails while one disagrees)."""
    for path in sorted(folder.glob("launch-*.json")):
        if not (text := launch_logs(path)):
            continue
        result = json.loads(path.read_text())
        job = cluster.settings(result["job"], **result.get("layout", {}))  # nodes, GPUs, tp, pp: as the run had them
        result["memory_log"], result["kv_tokens"] = rehearse.kv_record(text, kv_layout(job))
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"{path}: KV tokens {result['kv_tokens']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", nargs="?", help="a table of slurm/models.toml (a GPU job of one node)")
    ap.add_argument("--regenerate", type=Path, metavar="DIR", help="no GPU: re-derive the KV figures of every "
                    "launch-*.json in DIR from the vLLM logs beside it, with today's parser, and stop")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/llmlab-launch")))
    ap.add_argument("--job-id", default="900001", help="the SLURM_JOB_ID the launcher is given")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 64])
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for READY")
    ap.add_argument("--extra-vllm-args", default="", help="more vLLM flags (LLMLAB_EXTRA_VLLM_ARGS), e.g. to fail")
    for name in ("nodes", "gpus-per-node", "tp", "pp"):
        ap.add_argument(f"--{name}", type=int, help="override the job's layout (as llmlab launch does)")
    ap.add_argument("--backend", choices=("ray", "mp"), help="across nodes: Ray's executor or vLLM's own (--nnodes)")
    ap.add_argument("--gpu-type", help="the GPU the plan is checked against (as llmlab launch --gpu-type), e.g. "
                    "H200-141")
    ap.add_argument("--max-model-len", type=int, help="the context served (as llmlab launch --max-model-len)")
    ap.add_argument("--repeats", type=int, default=1, help="run the batch-1 run and the sweep this many times")
    ap.add_argument("--proxy-paired", type=int, nargs="*", default=[], metavar="C",
                    help="the proxy's cost at these concurrencies: paired runs through the proxy and on vLLM's socket "
                    "(benchmarks/proxy_overhead.py's run), --repeats times")
    ap.add_argument("--greedy", action="store_true", help="record a greedy completion of a fixed prompt (token ids): "
                    "layouts of the same seeded dummy weights must agree")
    ap.add_argument("--room", type=Path, metavar="TRACES", help="replay a room's traces against the READY job "
                    "(benchmarks/room_on_gpu.py's replay_one), once per --learners count")
    ap.add_argument("--learners", type=int, nargs="*", default=[30], help="learner counts for --room, in order")
    ap.add_argument("--room-stagger", type=float, default=1.0, help="seconds between learners' starts in --room")
    ap.add_argument("--room-ttft-p99-s", type=float, default=2.0, help="stop the replays once TTFT p99 passes this")
    ap.add_argument("--notebooks", nargs="*", default=[], help="lessons to run against the READY server "
                    "(benchmarks/notebooks_on_server.py), e.g. notebooks/03_online_inference.ipynb")
    ap.add_argument("--notebook-timeout", type=float, default=360.0,
                    help="seconds for all the notebooks together (a device call has 600 s in all)")
    a = ap.parse_args(argv)
    if a.regenerate:
        regenerate(a.regenerate)
        return 0
    if not a.job:
        ap.error("name a job of slurm/models.toml (or --regenerate DIR)")

    job = cluster.settings(a.job, nodes=a.nodes, gpus_per_node=a.gpus_per_node, tp=a.tp, pp=a.pp, backend=a.backend,
                           gpu=a.gpu_type, max_model_len=a.max_model_len)
    plan = cluster.check_layout(job)  # what llmlab launch checks before it submits: refused here as there
    out = a.out
    (out / "states").mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="llmlab-home-"))
    settings = home / "models.toml"  # the layout the launcher reads, as llmlab launch writes it
    settings.write_text(cluster.settings_toml(job))
    model_dir = home / "model"
    tok = rehearsal.make_dummy_model(job.model, model_dir)
    node = socket.gethostname()
    nodes = [node] if job.nodes == 1 else [f"{node}-{i}" for i in range(job.nodes)]
    env = {**os.environ, "LLMLAB_HOME": str(home), "SLURM_JOB_ID": a.job_id, "SLURM_JOB_NAME": f"llmlab-{a.job}",
           "LLMLAB_NODES": " ".join(nodes), "LLMLAB_MODEL_PATH": str(model_dir), "LLMLAB_SETTINGS_FILE": str(settings),
           "LLMLAB_EXTRA_VLLM_ARGS": f"--load-format dummy {a.extra_vllm_args}",
           "LLMLAB_PYTHON": sys.executable,
           # rehearse's probe plugin prints each GPU worker's memory figures in bytes: KV tokens exact, not rounded
           "PYTHONPATH": os.pathsep.join(filter(None, [str(rehearsal.write_probe(home / "probe")), str(REPO),
                                                       os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "LLMLAB_STOP_GRACE": "20"}
    _, extra_env, _ = rehearsal.serve_argv(job, model_dir, 0)
    env.update({k: v for k, v in extra_env.items() if k not in ("VLLM_API_KEY",)})
    if job.nodes > 1:  # the nodes are this host: srun runs each step here with that node's GPUs; Ray on 127.0.0.1
        env.update(PATH=f"{REPO / 'benchmarks' / 'onehost'}{os.pathsep}{env['PATH']}", LLMLAB_LOOPBACK="1",
                   LLMLAB_GPUS_PER_NODE=str(job.gpus_per_node))
    os.environ.update({"LLMLAB_HOME": str(home)})
    os.environ.pop("LLMLAB_BASE_URL", None)

    output = out / "job.out"
    t0 = time.monotonic()
    launcher = subprocess.Popen(["bash", str(REPO / "slurm" / "llmlab-serve.sh"), a.job], env=env,
                                stdout=output.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)

    def scontrol(_job_id):
        state = "RUNNING" if launcher.poll() is None else "COMPLETED"
        return {"JobState": state, "JobName": f"llmlab-{a.job}", "StdOut": str(output)}

    jobs.scontrol_job = scontrol
    seen, last = [], None
    result: dict = {"job": a.job, "job_id": a.job_id, "nodes": nodes, "states": seen,
                    "layout": {"nodes": job.nodes, "gpus_per_node": job.gpus_per_node, "tp": job.tp, "pp": job.pp,
                               "gpu": job.gpu, "max_model_len": job.max_model_len, "backend": job.backend},
                    "plan": plan}
    while True:
        st = jobs.status(a.job_id)
        line = f"{st.state}: {st.detail}"
        if line != last:
            stamp = round(time.monotonic() - t0, 1)
            seen.append({"t_s": stamp, "state": st.state, "detail": st.detail})
            print(f"[{stamp:7.1f} s] {line}", flush=True)
            n = len(seen)
            shutil.copy(output, out / "states" / f"{n:02d}-{st.state}.out")
            vlog = home / "logs" / f"job-{a.job_id}" / "vllm.log"
            if vlog.exists():
                shutil.copy(vlog, out / "states" / f"{n:02d}-{st.state}.vllm.log")
            last = line
        if st.state in ("READY", "FAILED", "STOPPED") or time.monotonic() - t0 > a.timeout:
            break
        time.sleep(1)
    result["ready_s"] = seen[-1]["t_s"] if st.state == "READY" else None
    ok = st.state == "READY"
    if ok:
        ok = exercise(a, job, tok, result)
    if ok and a.notebooks:  # the lessons, as a learner's kernel would run them against this job's server
        nb_env = {**os.environ, "PYTHONPATH": env["PYTHONPATH"],
                  "LLMLAB_CONNECTION_FILE": str(cluster.connection_file_of(a.job_id))}
        try:
            subprocess.run([sys.executable, str(REPO / "benchmarks" / "notebooks_on_server.py"),
                            *[str(REPO / n) for n in a.notebooks], "--out", str(out / "notebooks.json")],
                           env=nb_env, timeout=a.notebook_timeout)
        except subprocess.TimeoutExpired:
            print(f"the notebooks did not finish within {a.notebook_timeout:.0f} s", flush=True)
    # What scancel does: SIGTERM to the job's processes; the launcher's trap cleans up.
    t_stop = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    try:
        launcher.wait(timeout=90)
    except subprocess.TimeoutExpired:
        launcher.kill()
    result["cleanup_s"] = round(time.monotonic() - t_stop, 1)
    time.sleep(2)
    left = {"vllm": processes("vllm.entrypoints|VLLM::"), "proxy": processes("llmlab.serve.proxy"),
            "ray": processes("ray::|raylet|gcs_server")}
    files = {"connection file": (home / "servers" / f"job-{a.job_id}.json").exists(),
             "key": (home / "keys" / f"job-{a.job_id}.key").exists()}
    result["cleanup"] = {"processes_left": left, "files_left": files, "launcher_exit": launcher.returncode,
                         "status_after": str(jobs.status(a.job_id))}
    clean = not any(left.values()) and not any(files.values())
    print(f"clean-up in {result['cleanup_s']} s: {'clean' if clean else 'NOT CLEAN'} {left} {files}", flush=True)
    for src in sorted((home / "logs" / f"job-{a.job_id}").glob("*")):  # vllm.log, proxy.log, rendered.sh, ray-*.log
        if src.is_file():
            shutil.copy(src, out / src.name)
    (out / "launch.json").write_text(json.dumps(result, indent=1, default=str))
    shutil.rmtree(home, ignore_errors=True)
    return 0 if ok and clean else 1


def exercise(a, job, tok: dict, result: dict) -> bool:
    """What a notebook and an instructor do with a READY server: connect, ask, stream, read metrics, load it."""
    import llmlab

    client, model = llmlab.connect()
    comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, stream=True))
    streamed = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    result["completion"] = {"finish_reason": comp.choices[0].finish_reason,
                            "completion_tokens": comp.usage.completion_tokens, "model": comp.model}
    result["chat_stream"] = {"chunks": len(chunks), "content_chunks": streamed}
    print(f"completion: {comp.usage.completion_tokens} tokens ({comp.choices[0].finish_reason}); "
          f"streamed chat: {streamed} content chunks", flush=True)
    import openai

    try:  # the proxy refuses a request without the key
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()
        result["wrong_key"] = "ACCEPTED"
    except openai.AuthenticationError:
        result["wrong_key"] = "401"
    result["metrics"] = jobs.metrics(a.job_id, interval=1.0)
    print("metrics:", {k: v for k, v in result["metrics"].items() if "total" in k}, flush=True)
    info = json.loads(cluster.connection_file_of(a.job_id).read_text())
    srv = SimpleNamespace(base_url=f"http://{info['host']}:{info['port']}/v1",
                          api_key=Path(info["api_key_file"]).read_text().strip())
    # vllm.log, and with backend mp each other node's vllm-NODE.log: every GPU's probe line.  Read and kept before
    # the load, so that a run the lease cuts short keeps them (2026-11-28's TP=2 x PP=2 lost its second node's)
    logs = sorted(cluster.job_log_dir(a.job_id).glob("vllm*.log"))
    for log in logs:
        shutil.copy(log, a.out / "states" / f"ready-{log.name}")
    result["memory_log"], result["kv_tokens"] = rehearse.kv_record(
        "".join(p.read_text(errors="replace") for p in logs), kv_layout(job))
    kv = result["kv_tokens"]
    print(f"KV tokens: logged {kv['logged']:,}, predicted {kv['predicted']:,} ({kv['basis']})", flush=True)
    if a.greedy:
        result["greedy"] = greedy(client, model)
    save_result(a, result)
    result["benchmark_repeats"] = []
    for rep in range(a.repeats):  # batch 1 and the sweep, again: the spread between repeats is the interval
        print(f"sweep, repeat {rep + 1} of {a.repeats}", flush=True)
        result["benchmark_repeats"].append(rehearsal.benchmark(
            srv, job.name, tok["prompt_ids"], concurrency=tuple(a.concurrency), progress=False))
        save_result(a, result)
    result["benchmark"] = result["benchmark_repeats"][0]
    if a.proxy_paired:
        result["proxy_paired"] = proxy_paired(a, srv, job, tok)
        save_result(a, result)
    if a.room:
        result["room"] = room(a, srv, job)
    req = urllib.request.Request(srv.base_url.removesuffix("/v1") + "/metrics",
                                 headers={"Authorization": f"Bearer {srv.api_key}"})
    with urllib.request.urlopen(req, timeout=10) as r:  # the raw scrape: a fixture for the metric-name tests
        (a.out / "metrics.txt").write_bytes(r.read())
    return result["wrong_key"] == "401" and result["completion"]["completion_tokens"] > 0 and streamed > 0


def save_result(a, result: dict) -> None:
    """launch.json as far as it has got: a run cut short (the device's lease) keeps what it measured."""
    (a.out / "launch.json").write_text(json.dumps(result, indent=1, default=str))


def greedy(client, model: str) -> dict:
    """A fixed prompt's greedy completion, token ids and text: two layouts of the same seeded dummy weights should
    agree (TP and PP change the order of sums, so the first tokens are the fair comparison)."""
    comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=32, temperature=0,
                                     logprobs=1, extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    return {"prompt": "The capital of France is", "text": comp.choices[0].text, "tokens": lp.tokens,
            "token_logprobs": lp.token_logprobs}


def proxy_paired(a, srv, job, tok) -> dict:
    """benchmarks/proxy_overhead.py's paired runs on this job: the launcher's proxy (found by its command line,
    which names vLLM's socket) against the same requests sent to that socket directly."""
    import proxy_overhead

    line = next(p for p in processes("llmlab.serve.proxy") if "--upstream" in p)
    pid, argv = int(line.split()[0]), line.split()
    uds = argv[argv.index("--upstream") + 1].removeprefix("unix:")
    target = SimpleNamespace(base_url=srv.base_url, api_key=srv.api_key, uds=uds, name=job.name, group=None,
                             proxy=pid, workload=lambda n, seed: rehearsal.workload(n, tok["prompt_ids"], 64, 128,
                                                                                    seed=seed))
    args = SimpleNamespace(concurrency=a.proxy_paired, repeats=max(a.repeats, 3), requests_per_slot=2,
                           input_len=64, output_len=128)
    return proxy_overhead.run(args, target)


class CpuSampler(threading.Thread):
    """Every second, the CPU seconds of each vLLM, proxy and replay process (/proc/PID/stat), named by its pid and
    command line: a room whose requests wait before vLLM's clock starts (TTFT far above vLLM's own histogram) waits
    in a process of one core -- the proxy, or vLLM's API server -- and this says which.  (/proc/PID/comm would not:
    it says python3 for all of them; vLLM retitles its engine and workers VLLM::..., hence the pattern's case.)"""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.stopped, self.samples = path, threading.Event(), []

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.join()
        self.path.write_text("".join(json.dumps(s) + "\n" for s in self.samples))

    def run(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self.stopped.wait(1.0):
            sample = {"t": time.time()}
            for line in processes("vllm|VLLM|llmlab.serve.proxy|llmlab room"):
                pid, _, command = line.partition(" ")
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:  # ended between pgrep and the read
                    continue
                sample[f"{pid} {command[:60]}"] = (int(fields[11]) + int(fields[12])) / tick
            self.samples.append(sample)

    def busiest(self) -> dict:
        """Each process's highest CPU use over any 5 s of the replay, in cores, busiest first (top 8)."""
        rates: dict[str, float] = {}
        for a, b in zip(self.samples, self.samples[5:], strict=False):
            for name in a.keys() & b.keys() - {"t"}:
                rates[name] = max(rates.get(name, 0.0), (b[name] - a[name]) / (b["t"] - a["t"]))
        return dict(sorted(((n, round(r, 2)) for n, r in rates.items()), key=lambda x: -x[1])[:8])


def room(a, srv, job) -> list[dict]:
    """``llmlab room --replay`` against this job for each --learners count, until TTFT p99 passes the bound or a
    request fails (room_on_gpu.replay_one: each replay's folder keeps its per-request records)."""
    import room_on_gpu

    engine = SimpleNamespace(dir=a.out / "room", srv=srv, name=job.name, line="(the launcher's, rendered.sh)",
                             gpus=list(range(job.gpus_per_node)))
    engine.dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for k in a.learners:
        with CpuSampler(engine.dir / f"cpu-{k}.jsonl") as cpu:
            row = room_on_gpu.replay_one(engine, a.room, k, a.room_stagger)
        row["busiest_cpu"] = cpu.busiest()
        rows.append(row)
        p99 = (row.get("ttft_ms") or {}).get("p99")
        print(f"room of {k}: TTFT p99 {p99} ms, failures {row.get('failures')}", flush=True)
        if p99 is None or p99 > a.room_ttft_p99_s * 1000 or row.get("failures"):
            break
    return rows


if __name__ == "__main__":
    sys.exit(main())
