"""A workshop room's request traces replayed against the ``llama3.1-8b`` job on real GPUs (issue 36): how many
learners one GPU server holds.

    python benchmarks/room_on_gpu.py --traces benchmarks/results/cpu-room-10 --out DIR \\
        --wave 1@0:300 1@1:30,100 --wave 2@0,1:300,100,30

Each ``--wave`` is a set of engines started side by side and measured at once; a wave starts when the one before
it has stopped.  An engine is ``TP@GPUS:LEARNERS``: the ``llama3.1-8b`` job of ``slurm/models.toml`` at
tensor-parallel size TP on those GPUs, against which ``llmlab room --replay TRACES --learners K`` runs once for each
K in turn (a process of its own, finding the server through ``LLMLAB_BASE_URL`` and ``LLMLAB_API_KEY`` as a
script would).  Meanwhile the engine's ``/metrics`` is scraped every half second (running and waiting requests, KV
use), as ``llmlab room`` does for a rehearsed room.

On the course's lent machines, which download nothing: ``benchmarks/rehearse_on_device.sh room ...``.

Every engine is the rehearsal's (``benchmarks/lessons_on_gpu.py``'s ``Engine``): the launcher's ``vllm serve`` line
for the job (full 131,072-token context, ``--gpu-memory-utilization 0.9``) with ``--load-format dummy``, on a
private Unix socket behind llmlab's proxy.  The dummy model's tokenizer is the tiny model's byte-level BPE padded
to Llama 3.1's 128,256 ids (``llmlab.ops.rehearsal.make_tokenizer``), so the traces' prompts, which were written
against the tiny model, have the same token counts here; each request asks for the completion tokens the learner
got (``ignore_eos``).  Results are written as each replay ends: ``DIR/<engine>/replay.json`` (the runs so far, each
with the server's peaks), ``replay.log`` (each command and its output), ``server-metrics-<K>.jsonl``, and
``DIR/room.json`` (every engine's serve line, start-up and memory lines, and runs), so a run cut short keeps what it
finished.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from lessons_on_gpu import PACKAGE_ROOT, Engine, save, slug, start_all

from llmlab.ops import rehearsal
from llmlab.ops.room import Scraper


def parse_engine(spec: str) -> tuple[int, list[int], list[int]]:
    """``TP@GPUS:LEARNERS`` (``1@0:300``, ``2@0,1:300,100``) -> (tp, gpus, learner counts)."""
    try:
        tp, rest = spec.split("@", 1)
        gpus, learners = rest.split(":", 1)
        out = int(tp), [int(g) for g in gpus.split(",")], [int(k) for k in learners.split(",")]
    except ValueError:
        raise SystemExit(f"--wave {spec!r}: give TP@GPUS:LEARNERS, e.g. 1@0:300 or 2@0,1:300,100") from None
    if len(out[1]) != out[0]:
        raise SystemExit(f"--wave {spec!r}: TP={out[0]} needs {out[0]} GPU(s), not {len(out[1])}")
    return out


def engine_name(tp: int, gpus: list[int]) -> str:
    return f"tp{tp} gpu{'-'.join(map(str, gpus))}"


def peaks(samples: list[dict]) -> dict:
    return {"running": max((s["running"] for s in samples), default=None),
            "waiting": max((s["waiting"] for s in samples), default=None),
            "kv_pct": round(max((s["kv_pct"] for s in samples), default=0.0), 2) if samples else None,
            "samples": len(samples)}


def replay_one(engine: Engine, traces: Path, k: int, stagger: float) -> dict:
    """``llmlab room --replay`` for ``k`` learners against ``engine``, its ``/metrics`` scraped meanwhile; the run's
    row of replay.json with the server's peaks added."""
    folder = engine.dir / f"learners-{k}"
    folder.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "llmlab", "room", "--replay", str(traces), "--learners", str(k),
            "--stagger", str(stagger), "--out", str(folder)]
    env = {**os.environ, "LLMLAB_BASE_URL": engine.srv.base_url, "LLMLAB_API_KEY": engine.srv.api_key,
           "LLMLAB_HOME": str(folder / "home"), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)}
    shown = f"$ LLMLAB_BASE_URL={engine.srv.base_url} LLMLAB_API_KEY=... llmlab {' '.join(argv[3:])}"
    scraper = Scraper(engine.srv.base_url, engine.srv.api_key)
    scraper.start()
    started = time.time()
    try:
        done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finally:
        scraper.stopped.set()
        scraper.join()
    with open(engine.dir / "replay.log", "a") as log:
        log.write(f"{shown}\n{done.stdout}exit {done.returncode}\n")
    print(f"{engine.name}, {k} learners:\n{done.stdout}", flush=True)
    with open(engine.dir / f"server-metrics-{k}.jsonl", "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in scraper.samples)
    path = folder / "replay.json"
    failed = {"runs": [{"learners": k, "failed": done.stdout[-2000:]}]}  # the replay itself broke: its output
    report = json.loads(path.read_text()) if path.exists() else failed
    row = {**report["runs"][0], "server_peaks": peaks(scraper.samples), "scrape_errors": scraper.errors,
           "started": time.strftime("%H:%M:%S", time.gmtime(started)), "exit": done.returncode}
    merged = engine.dir / "replay.json"
    whole = json.loads(merged.read_text()) if merged.exists() else {**report, "learners": [], "runs": []}
    whole["learners"].append(k)
    whole["runs"].append(row)
    whole.update(serve_line=engine.line, gpus=engine.gpus)
    merged.write_text(json.dumps(whole, indent=1) + "\n")
    return row


def run_wave(specs: list[str], traces: Path, out: Path, stagger: float, timeout: float) -> None:
    """Start the wave's engines side by side, replay each one's learner counts (the engines at once), stop them."""
    plans = [parse_engine(s) for s in specs]
    engines: list[Engine] = []
    try:
        for tp, gpus, _ in plans:
            engines.append(Engine(engine_name(tp, gpus), gpus, out, tp=tp))
        start_all(engines, timeout)
        for e in engines:
            save(out, e.name, {"serve_line": e.line, "startup_s": round(e.startup_s, 1), "memory": e.memory(),
                               "runs": []})
        lock = threading.Lock()

        def drive(e: Engine, counts: list[int]) -> None:
            for k in counts:
                row = replay_one(e, traces, k, stagger)
                with lock:
                    data = json.loads((out / f"{out.name}.json").read_text())
                    data[e.name]["runs"].append(row)
                    (out / f"{out.name}.json").write_text(json.dumps(data, indent=2) + "\n")

        threads = [threading.Thread(target=drive, args=(e, plan[2])) for e, plan in zip(engines, plans, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for e in engines:
            e.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, required=True, help="a room's report folder (its traces/) or the traces")
    ap.add_argument("--wave", nargs="+", action="append", required=True, metavar="TP@GPUS:LEARNERS",
                    help="engines started and measured together, e.g. 1@0:300 1@1:30,100; repeat for the next wave")
    ap.add_argument("--stagger", type=float, default=1.0, help="seconds between two replayed learners (default 1)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds for each engine's /health")
    args = ap.parse_args()
    facts = rehearsal.gpu_facts()
    needed = max(g for wave in args.wave for s in wave for g in parse_engine(s)[1]) + 1
    if facts.get("count", 0) < needed:
        sys.exit(f"{facts.get('count', 0)} GPU(s) here: the waves name GPU {needed - 1}.")
    out = args.out / "room"
    out.mkdir(parents=True, exist_ok=True)
    save(out, "machine", {"gpu": facts["name"], "gpus": facts["count"], "torch": facts.get("torch"),
                          "date": time.strftime("%Y-%m-%d"), "traces": str(args.traces), "stagger_s": args.stagger,
                          "waves": args.wave})
    for wave in args.wave:
        print(f"=== wave {' '.join(wave)} ({time.strftime('%H:%M:%S')})", flush=True)
        run_wave(wave, args.traces, out, args.stagger, args.timeout)
    print(f"done: {', '.join(slug(engine_name(*parse_engine(s)[:2])) for w in args.wave for s in w)}", flush=True)


if __name__ == "__main__":
    main()
