"""The held-out check of ``llmlab.memory.predict_kv_before_launch`` (issue 39): start each run of
``benchmarks/results/kv-before-launch-held-out.json`` -- whose predictions were committed before any of them ran --
with exactly its ``vllm_flags``, and keep what vLLM logged.

    python benchmarks/kv_held_out_on_gpu.py h100-qwen3-8b-tp1 --out DIR
    python benchmarks/kv_held_out_on_gpu.py h100-llama3.1-8b-tp1-batched-16k --out DIR \\
        --parity "--repeats 8 ..."        # then benchmarks/loadtest_parity_on_gpu.py against the same server

On the course's lent machines, which download nothing: ``benchmarks/rehearse_on_device.sh python
benchmarks/kv_held_out_on_gpu.py ...``.

Each run: the dummy model folder of its model (``llmlab.ops.rehearsal.make_dummy_model``: config.json and a
generated tokenizer), ``vllm serve`` with the run's flags plus only ``--served-model-name MODEL`` (which the table
reads the model from) and ``--host/--port``, vLLM's defaults for everything else, the rehearsal's read-only probe
plugin (the same figures in bytes) and, as every llmlab GPU start-up without FlashInfer, its sampler off.  Once
``/health`` answers (the "Free memory on device" line, printed after the CUDA graphs, gives the GPU's size), the
log's excerpt is written to ``DIR/<run>/server-log-excerpt.txt`` -- where ``llmlab.rehearse.before_launch_table``
reads every committed run -- and ``DIR/<run>/kv-held-out.json`` holds logged vs predicted.  The committed
predictions are never touched here: ``DIR/kv-held-out.json`` lists the logged figures to copy in.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import sys
import time
from pathlib import Path

from llmlab import rehearse
from llmlab.ops import rehearsal
from llmlab.serve.vllm import VLLMProcess, local_env, vllm_env, vllm_serve

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = ROOT / "benchmarks" / "results" / "kv-before-launch-held-out.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(run: dict, folder: Path, timeout: float) -> tuple[VLLMProcess, Path, float]:
    """Start the run's server and wait for /health; returns it, its dummy model folder and the start-up seconds."""
    model = run["inputs"]["model"]
    model_dir = folder / "model"
    rehearsal.make_dummy_model(model, model_dir)
    probe = rehearsal.write_probe(folder / "probe")
    flags = [*shlex.split(run["vllm_flags"]), "--served-model-name", model, "--host", "127.0.0.1",
             "--port", str(free_port())]
    env = local_env(vllm_env("gpu", flashinfer=False))
    # the probe imports llmlab: this process's (PYTHONPATH first), else the checkout's
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(probe), os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    argv = vllm_serve(sys.executable, model_dir, flags)
    srv = VLLMProcess(argv, env, folder / "server.log", host="127.0.0.1", port=int(flags[-1]))
    t0 = time.monotonic()
    srv.start()
    try:
        srv.wait_ready(timeout, progress=False)
    except BaseException:
        srv.stop(grace=10)
        (folder / rehearsal.LOG_EXCERPT).write_text(rehearsal.log_excerpt(srv.log_path))
        raise
    return srv, model_dir, time.monotonic() - t0


def record(run: dict, folder: Path, startup_s: float, root: Path) -> dict:
    """The excerpt (the file the committed table reads) and logged vs predicted, read back from it."""
    excerpt = folder / rehearsal.LOG_EXCERPT
    excerpt.write_text(rehearsal.log_excerpt(folder / "server.log"))
    row = rehearse.before_launch_row(excerpt, root)
    mem = rehearse.parse_memory_log(excerpt.read_text())
    out = {"name": run["name"], "vllm_flags": run["vllm_flags"], "committed_prediction": run["predicted_before_launch"],
           "logged": row["logged"], "predicted_from_the_log": row["predicted_before_launch"],
           "error": (run["predicted_before_launch"] - row["logged"]) / row["logged"],
           "gpu_total_gib": mem.total_gib, "vllm_version": mem.vllm_version, "runner": row["runner"],
           "startup_s": round(startup_s, 1), "probe": mem.probe,
           "date": time.strftime("%Y-%m-%d", time.gmtime())}
    (folder / "kv-held-out.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"{run['name']}: logged {out['logged']:,} KV tokens, predicted before launch {out['committed_prediction']:,}"
          f" -> error {out['error']:+.3%} (the table's own prediction from this log: "
          f"{out['predicted_from_the_log']:,}); /health after {startup_s:.0f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="names of kv-before-launch-held-out.json's runs")
    ap.add_argument("--out", type=Path, required=True, help="a folder; each run writes DIR/<name>/")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for each server's /health")
    ap.add_argument("--parity", metavar="ARGS", help="after the LAST run is up: benchmarks/loadtest_parity_on_gpu.py "
                                                      "with these arguments against it (its --out is DIR/parity)")
    ap.add_argument("--wait-for", type=Path, metavar="FILE",
                    help="before the last run, wait (up to an hour) until FILE exists: another job on the machine "
                         "(a staging benchmark) has ended, so that nothing else loads it during the timings")
    a = ap.parse_args(argv)
    runs = {r["name"]: r for r in json.loads(HELD_OUT.read_text())["runs"]}
    unknown = [n for n in a.runs if n not in runs]
    if unknown:
        ap.error(f"not in {HELD_OUT.name}: {', '.join(unknown)} (it has {', '.join(runs)})")
    summary, status = {}, 0
    for i, name in enumerate(a.runs):
        folder = a.out / name
        folder.mkdir(parents=True, exist_ok=True)
        if a.wait_for and i == len(a.runs) - 1 and not a.wait_for.exists():
            print(f"waiting for {a.wait_for} ({time.strftime('%H:%M:%S')})", flush=True)
            end = time.monotonic() + 3600
            while not a.wait_for.exists() and time.monotonic() < end:
                time.sleep(2)
        print(f"=== {name}: vllm serve MODEL {runs[name]['vllm_flags']} ({time.strftime('%H:%M:%S')})", flush=True)
        try:
            srv, model_dir, startup_s = start(runs[name], folder, a.timeout)
        except Exception as e:  # noqa: BLE001 -- the next run still runs; the excerpt says why this one failed
            print(f"{name}: FAILED to start: {e}", flush=True)
            status = 1
            continue
        try:
            summary[name] = record(runs[name], folder, startup_s, a.out)
            (a.out / "kv-held-out.json").write_text(json.dumps(summary, indent=1) + "\n")
            if a.parity and i == len(a.runs) - 1:
                import loadtest_parity_on_gpu

                status |= loadtest_parity_on_gpu.main([
                    *shlex.split(a.parity), "--base-url", srv.base_url, "--model", runs[name]["inputs"]["model"],
                    "--tokenizer", str(model_dir), "--server", f"{name}: {runs[name]['vllm_flags']}",
                    "--out", str(a.out / "parity")])
        finally:
            srv.stop(grace=30)
            for leftover in ("model", "probe"):
                shutil.rmtree(folder / leftover, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
