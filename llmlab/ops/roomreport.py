"""The figures of a rehearsed room (``llmlab room``) and the replay of its traces for larger rooms.

Why separate from :mod:`llmlab.ops.room`: the room's run needs root, SLURM and minutes; its figures are pure
functions of the files it leaves (``learners/NAME.results.json``, ``learners/NAME.events.jsonl``,
``traces/NAME.trace.jsonl``, the ``/metrics`` samples) and are tested on their own.

``report.json`` holds: ``learners`` (how many) and ``names``; ``cells_failed`` (learner, notebook, cell, the error's
last line; the goal is none); ``path_seconds`` per learner (first notebook opened -> last cell run) and
``fairness`` (slowest / median, over the learners who walked the whole path); ``latency_ms`` and ``ttfb_ms``
(p50/p99 of the generation requests as the learners' kernels saw them); ``server`` (peak running and waiting
requests, peak KV-cache use, from ``/metrics`` every 0.5 s); ``revocation`` (who, when, what the instructor was
told, and the one sentence the learner got); ``restart`` (whose kernel, where, and whether they finished);
``handed_in`` (the learners ``llmlab progress --room`` lists); ``job_status`` (what ``llmlab status JOB`` said
after the path: the learners registered and revoked); ``left_behind`` (what the clean-up did not remove;
the goal is none); ``wall_s``.

:func:`replay` sends the recorded traces again for K learners (no kernels): each replayed learner is one of the
recorded ones, in turn, and sends its requests at the same offsets from its first one, with llmlab's load
generator (``llmlab.loadtest``), asking for as many tokens as the learner got (``ignore_eos``) so that the server
does the same work.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from llmlab.ops.roomtrace import is_generation


def read_jsonl(path: Path) -> list[dict]:
    out = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a killed process
    return out


def percentiles_ms(values: list[float]) -> dict:
    from llmlab.loadtest import percentile

    ms = [v * 1000 for v in values]
    return {"p50": _round(percentile(ms, 50)), "p99": _round(percentile(ms, 99)), "requests": len(ms)}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def results_of(out: Path, names: list[str]) -> dict[str, dict]:
    found = {}
    for name in names:
        path = out / "learners" / f"{name}.results.json"
        if path.exists():
            found[name] = json.loads(path.read_text())
    return found


def cells_failed(results: dict[str, dict]) -> list[dict]:
    """Every failed cell a learner saw, those before a kernel restart included (the refusal of a revoked key is
    not a failure: :func:`revocation` reports it)."""
    out = []
    for name, r in results.items():
        before = (r.get("restarted") or {})
        for f in before.get("failed_before", []):
            out.append({"learner": name, "notebook": before["notebook"], "cell": f["cell"], "error": f["error"],
                        "raised_at": f.get("raised_at", ""), "before_restart": True})
        out += [{"learner": name, "notebook": nb["notebook"], "cell": f["cell"], "error": f["error"],
                 "raised_at": f.get("raised_at", "")} for nb in r.get("notebooks", []) for f in nb.get("failed", [])]
    return out


def path_seconds(results: dict[str, dict]) -> dict[str, float]:
    """First notebook opened -> last cell run (the hand-in after it is not the path)."""
    return {name: round(r["end"] - r["start"], 1) for name, r in results.items() if "end" in r}


def fairness(seconds: dict[str, float], finished: list[str]) -> float | None:
    times = [seconds[n] for n in finished if n in seconds]
    return round(max(times) / statistics.median(times), 3) if times else None


def request_figures(traces: dict[str, list[dict]]) -> dict:
    gen = [line for lines in traces.values() for line in lines if is_generation(line)]
    ok = [line for line in gen if line.get("status") == 200 and not line.get("error")]
    return {"latency_ms": percentiles_ms([line["elapsed_s"] for line in ok]),
            "ttfb_ms": percentiles_ms([line["ttfb_s"] for line in ok if line.get("ttfb_s") is not None]),
            "requests": {"all": sum(map(len, traces.values())), "generation": len(gen), "generation_ok": len(ok),
                         "prompt_tokens": sum(line.get("prompt_tokens") or 0 for line in ok),
                         "completion_tokens": sum(line.get("completion_tokens") or 0 for line in ok)}}


def server_figures(samples: list[dict], errors: int) -> dict:
    def peak(key):
        return max((s[key] for s in samples), default=None)

    return {"peak_running": peak("running"), "peak_waiting": peak("waiting"),
            "peak_kv_pct": _round(peak("kv_pct")), "samples": len(samples), "failed_scrapes": errors}


def revocation(plan: dict, results: dict[str, dict]) -> dict | None:
    who = plan.get("revoked")
    if not who:
        return None
    got = results.get(who, {}).get("refused")
    done = plan.get("revocation") or {}
    return {"learner": who, "at_notebook": plan.get("revoke_at"), "instructor": done.get("said"),
            "refused": bool(got), "sentence": got and got.get("sentence"),
            "where": got and f"{got['notebook']} cell {got['cell']}",
            "others_refused": [n for n, r in results.items() if n != who and r.get("refused")]}


def restart(plan: dict, results: dict[str, dict]) -> dict | None:
    who = plan.get("restarted")
    if not who:
        return None
    r = results.get(who, {})
    got = r.get("restarted") or {}
    walked = not r.get("refused") and len(r.get("notebooks", [])) == len(plan.get("path", []))
    return {"learner": who, "notebook": got.get("notebook"), "after_cell": got.get("after_cell"),
            "notebook_completed": bool(got.get("completed")), "path_completed": bool(got) and walked}


def build(room, plan: dict, listing: tuple[list[dict], str], behind: list[str], wall_s: float) -> dict:
    """report.json's content (the module docstring lists its keys)."""
    out = room.out
    results = results_of(out, room.learners)
    traces = {n: read_jsonl(out / "traces" / f"{n}.trace.jsonl") for n in room.learners}
    samples = plan.get("metrics", [])
    (out / "server-metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    seconds = path_seconds(results)
    finished = [n for n, r in results.items() if not r.get("refused")]
    rows = listing[0] if listing else []
    return {"learners": len(room.learners), "names": room.learners, "group": room.group, "job": room.job_id,
            "cells_failed": cells_failed(results), "path_seconds": seconds,
            "fairness": fairness(seconds, finished), **request_figures(traces),
            "server": server_figures(samples, plan.get("metrics_errors", 0)),
            "revocation": revocation(plan, results), "restart": restart(plan, results),
            "handed_in": [row.get("user") for row in rows],
            "hand_in_output": {n: r.get("hand_in", {}).get("output") for n, r in results.items()},
            "progress_room": listing[1] if listing else "", "job_status": plan.get("job_status"),
            "exit_codes": plan.get("exit_codes", {}),
            "missing_results": [n for n in room.learners if n not in results],
            "left_behind": behind, "wall_s": round(wall_s, 1)}


def plot_timelines(out: Path, report: dict) -> Path:
    """timelines.png: a row per learner, a bar per notebook, a tick per request; the server's queue below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = report["names"]
    events = {n: read_jsonl(out / "learners" / f"{n}.events.jsonl") for n in names}
    traces = {n: read_jsonl(out / "traces" / f"{n}.trace.jsonl") for n in names}
    samples = read_jsonl(out / "server-metrics.jsonl")
    t0 = min([e[0]["t"] for e in events.values() if e] + [s["t"] for s in samples[:1]], default=time.time())
    fig, (ax, server) = plt.subplots(2, 1, figsize=(13, 1.2 + 0.7 * len(names) + 2.2), sharex=True,
                                     gridspec_kw={"height_ratios": [max(2, len(names)), 2]})
    colors = plt.get_cmap("tab10")
    order: dict[str, int] = {}
    for row, name in enumerate(names):
        opened = [e for e in events[name] if e["kind"] in ("notebook", "done")]
        for a, b in zip(opened, opened[1:], strict=False):
            if a["kind"] == "notebook":
                c = order.setdefault(a["notebook"], len(order))
                ax.barh(row, b["t"] - a["t"], left=a["t"] - t0, height=0.6, color=colors(c % 10), alpha=0.55,
                        label=a["notebook"] if c == len(order) - 1 and row == 0 else None)
        for line in traces[name]:
            ax.plot([line["start"] - t0] * 2, [row - 0.3, row + 0.3], color="black", lw=0.5)
        for e in events[name]:
            if e["kind"] == "restart":
                ax.plot(e["t"] - t0, row, "x", color="red", ms=10, mew=2)
            if e["kind"] == "cell" and e.get("error"):
                ax.plot(e["t"] - t0, row, "s" if e.get("refused") else "v", color="darkred", ms=6)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors(i % 10), alpha=0.55) for i in order.values()]
    ax.legend(handles, list(order), loc="upper right", fontsize=7, ncol=4)
    ax.set_yticks(range(len(names)), [n.rsplit("-", 1)[-1] for n in names])
    ax.invert_yaxis()
    ax.set(ylabel="learner", title="The room: a bar per notebook, a tick per request (x: kernel restart, "
                                   "v: a failed cell, square: the key refused)")
    if samples:
        ts = [s["t"] - t0 for s in samples]
        server.plot(ts, [s["running"] for s in samples], label="running")
        server.plot(ts, [s["waiting"] for s in samples], label="waiting")
        server.legend(loc="upper right", fontsize=8)
    server.set(xlabel="seconds since the first learner sat down", ylabel="requests")
    fig.tight_layout()
    path = out / "timelines.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------------------------------

def load_traces(trace_dir: Path) -> dict[str, list[dict]]:
    """The generation requests of each recorded learner (``traces/*.jsonl`` of a room's report, or the folder)."""
    folder = Path(trace_dir)
    folder = folder / "traces" if (folder / "traces").is_dir() else folder
    traces = {p.name.split(".")[0]: [line for line in read_jsonl(p) if is_generation(line)]
              for p in sorted(folder.glob("*.jsonl"))}
    traces = {k: v for k, v in traces.items() if v}
    if not traces:
        raise FileNotFoundError(f"{folder} holds no request trace with a generation request: give the report folder "
                                "of `llmlab room` (its traces/ folder).")
    return traces


def prompt_text(line: dict) -> str | list[int]:
    if "prompt" in line:
        return line["prompt"] if isinstance(line["prompt"], str | list) else str(line["prompt"])
    return "\n".join(str(m.get("content", "")) for m in line.get("messages", []))


def schedule(traces: dict[str, list[dict]], k: int, stagger: float) -> list[tuple[float, object]]:
    """(seconds from the start, Job) for ``k`` learners: learner i replays recorded learner i mod R, starting
    ``i * stagger`` s in, each request at its recorded offset from that learner's first request."""
    from llmlab.loadtest import Job

    recorded = list(traces.values())
    out = []
    for i in range(k):
        lines = recorded[i % len(recorded)]
        first = min(line["start"] for line in lines)
        for j, line in enumerate(lines):
            tokens = line.get("completion_tokens") or line.get("max_tokens") or 1
            out.append((i * stagger + line["start"] - first,
                        Job(id=f"{i}-{j}", prompt=prompt_text(line), max_tokens=max(1, int(tokens)))))
    return sorted(out, key=lambda x: x[0])


async def _drive(client, model: str, plan, timeout: float):
    import asyncio
    import uuid

    from llmlab.loadtest.driver import _endpoint, _open_session
    from llmlab.loadtest.request import _send_async, _Settings

    base_url, headers, params = _endpoint(client, {"temperature": 0, "ignore_eos": True})
    cfg = _Settings(model, 16, timeout, params, uuid.uuid4().hex[:8], 0, base_url)
    late: list[float] = []
    async with await _open_session(0, timeout) as session:  # limit 0: a connection for every request in flight
        loop, t0 = asyncio.get_running_loop(), asyncio.get_running_loop().time()

        async def one(at: float, job):
            await asyncio.sleep(max(0.0, at - (loop.time() - t0)))
            late.append(max(0.0, loop.time() - t0 - at))
            return await _send_async(session, f"{base_url}/completions", headers, job, cfg)

        records = await asyncio.gather(*(one(at, job) for at, job in plan))
    return records, late


def save_records(path: Path, records) -> Path:
    """One JSON line per request (``llmlab.loadtest.Record``'s fields: id, status, times, tokens, error), gzipped:
    30 learners make 4,950 requests, 300 make 49,500.  A replay's completions are not kept (its prompts are the
    traces', its answers nobody's) and times are rounded to the microsecond: 100 learners' records took 5.3 MB
    with both, 1.9 MB without (benchmarks/results/README.md, round2)."""
    import gzip
    from dataclasses import asdict

    def micro(v):
        return round(v, 6) if isinstance(v, float) else [micro(x) for x in v] if isinstance(v, list) else v

    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps({k: micro(v) for k, v in asdict(r).items() if k != "text"}) + "\n" for r in records)
    return path


def replay(trace_dir: str | Path, learners=(30, 100, 300), *, stagger: float = 1.0, timeout: float = 300.0,
           client=None, model: str | None = None, out: str | Path | None = None, progress=print) -> dict:
    """Replay the traces for each K in ``learners`` against the server ``llmlab.connect()`` finds (or ``client``);
    returns (and writes to ``out``/replay.json) one row per K: TTFT and latency p50/p99, failures; with ``out``,
    every request's record too (``replay-K.records.jsonl.gz``)."""
    import asyncio

    from llmlab.loadtest import summarize
    from llmlab.serve.proc import raise_fd_limit

    traces = load_traces(Path(trace_dir))
    if client is None:
        import llmlab

        client, model = llmlab.connect(quiet=True)
    raise_fd_limit()  # hundreds of learners x the path's bursts of eight: more sockets than a default 1024
    rows = []
    for k in learners:
        plan = schedule(traces, int(k), stagger)
        progress(f"replay: {k} learners, {len(plan)} requests over {plan[-1][0]:.0f} s of schedule")
        started = time.time()
        records, late = asyncio.run(_drive(client, model, plan, timeout))
        if out is not None:  # every request, so that anyone can recompute the percentiles (or others) from them
            save_records(Path(out) / f"replay-{int(k)}.records.jsonl.gz", records)
        s = summarize(records)
        failures = [r.error for r in records if r.status != "ok"]
        rows.append({"learners": int(k), "requests": s["requests"], "ok": s["ok"], "failures": len(failures),
                     "first_failures": sorted(set(failures))[:3],
                     "ttft_ms": {q: _round(s[f"ttft_{q}"] * 1000 if s[f"ttft_{q}"] is not None else None)
                                 for q in ("p50", "p99")},
                     "latency_ms": {q: _round(s[f"latency_{q}"] * 1000 if s[f"latency_{q}"] is not None else None)
                                    for q in ("p50", "p99")},
                     "max_in_flight": s["max_concurrency_seen"], "sent_late_p99_s": round(
                         sorted(late)[int(0.99 * (len(late) - 1))], 3) if late else None,
                     "wall_s": round(time.time() - started, 1)})
        progress(f"  {k} learners: TTFT p50 {rows[-1]['ttft_ms']['p50']} ms, p99 {rows[-1]['ttft_ms']['p99']} ms; "
                 f"latency p50 {rows[-1]['latency_ms']['p50']} ms; {len(failures)} failed")
    report = {"learners": [int(k) for k in learners], "recorded": list(traces), "server": str(client.base_url),
              "model": model, "stagger_s": stagger, "runs": rows}
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "replay.json").write_text(json.dumps(report, indent=1))
    return report
