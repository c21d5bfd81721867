"""Staging weights to node-local disk (``llmlab weights stage``): its time, and reading the weights shared vs local.

Why: a large job that reads its weights from a network file system spends its first minutes there (issue 41);
``llmlab weights stage`` copies them to node-local disk first.  This measures, on one machine, for one tree:

- **read, shared / local, cold**: every file of the tree read once from the "shared" folder, and from the node-local
  copy, after its pages are dropped from the page cache (``fsync`` then ``posix_fadvise(DONTNEED)`` on each file:
  this process's files only, no root, nothing else evicted) -- what vLLM's load reads;
- **read, warm**: the same with the pages cached (a second job on the node, or a tree smaller than the memory);
- **stage, cold**: ``llmlab.ops.weights.stage`` from the shared folder (its pages dropped) to a fresh local folder:
  the copy's own time and MB/s as the command prints them, and the wall time with the verification around it;
- **stage, skipped**: the second run, which verifies the local copy (headers and sizes) and copies nothing.

Each figure is the median of ``--repeats`` runs, with the range.  The tree: a copy of the shipped tiny model
(14.7 MB, default) or ``--dummy NAME``, a config's tensors at full size in 5 GB shards (``weights.dummy_tree``;
``--dummy llama3.1-8b`` writes 16 GB).  Which folders are "shared" and "local" is the caller's: on a cluster, a
folder of the shared file system and one on the node's own disk; ``df`` says what each is, printed first.

    .venv/bin/python benchmarks/stage_weights.py --repeats 5 --out benchmarks/results/cpu-stage-weights
    python benchmarks/stage_weights.py --dummy llama3.1-8b --shared /shared/scratch/x --local /tmp/x --repeats 3

Figures, not pass/fail: see CONVENTIONS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llmlab import memory
from llmlab.ops import weights

ROOT = Path(__file__).resolve().parents[1]


def files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def drop_cache(root: Path) -> None:
    """Flush and drop the page cache of every file of ``root`` (clean pages only can be dropped: fsync first)."""
    for p in files(root):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(root: Path) -> tuple[float, int]:
    """Seconds to read every file of ``root`` once, in 16 MiB blocks, and the bytes read."""
    total, started = 0, time.perf_counter()
    for p in files(root):
        with open(p, "rb", buffering=0) as f:
            while block := f.read(weights.CHUNK):
                total += len(block)
    return time.perf_counter() - started, total


def df(path: Path) -> str:
    out = subprocess.run(["df", "-hT", str(path)], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 else f"(df failed: {out.stderr.strip()})"


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dummy", metavar="MODEL", help="a dummy tree of this shipped config (default: the tiny model)")
    ap.add_argument("--shared", type=Path, default=ROOT / "build" / "stage-weights" / "shared",
                    help="the 'shared' folder the tree is written to (default: build/ of this checkout)")
    ap.add_argument("--local", type=Path, default=Path("/tmp/llmlab-stage-weights"),
                    help="the node-local folder staged to (default /tmp/llmlab-stage-weights)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, help="write stage_weights.json and stage_weights.txt there")
    ap.add_argument("--keep", action="store_true", help="keep both trees afterwards")
    a = ap.parse_args(argv)

    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    name = a.dummy or memory.TINY_NAME
    src = a.shared / name
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(a.local, ignore_errors=True)
    started = time.perf_counter()
    if a.dummy:
        weights.dummy_tree(a.dummy, src)
    else:
        shutil.copytree(memory.MODELS_DIR / memory.TINY_NAME, src)
    weights.make_group_readable(src)
    made = time.perf_counter() - started
    verdict = weights.verify(src)
    if not verdict.ok:
        print("\n".join(verdict.problems), file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in files(src))
    say(f"$ {' '.join([Path(sys.executable).name, 'benchmarks/stage_weights.py', *(argv or sys.argv[1:])])}")
    say(f"tree     {name}: {size / 1e6:,.1f} MB in {verdict.shards} shard(s), {verdict.params:,} parameters "
        f"(verified; written in {made:.1f} s)")
    say(f"shared   {src}   [{df(a.shared)}]")
    say(f"local    {a.local / name}   [{df(a.local.parent if not a.local.exists() else a.local)}]")
    say(f"machine  {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}")

    runs: dict[str, list[float]] = {k: [] for k in ("read_shared_cold", "read_shared_warm", "stage_copy",
                                                    "stage_wall", "read_local_cold", "read_local_warm",
                                                    "stage_skipped")}
    for _ in range(a.repeats):
        shutil.rmtree(a.local, ignore_errors=True)
        drop_cache(src)
        runs["read_shared_cold"].append(read_all(src)[0])
        runs["read_shared_warm"].append(read_all(src)[0])
        drop_cache(src)
        t0 = time.perf_counter()
        result = weights.stage(src, a.local, progress=False, say=lambda *x: None)
        runs["stage_wall"].append(time.perf_counter() - t0)
        runs["stage_copy"].append(result["seconds"])
        dest = Path(result["dest"])
        drop_cache(dest)
        runs["read_local_cold"].append(read_all(dest)[0])
        runs["read_local_warm"].append(read_all(dest)[0])
        t0 = time.perf_counter()
        again = weights.stage(src, a.local, progress=False, say=lambda *x: None)
        assert again["skipped"], again
        runs["stage_skipped"].append(time.perf_counter() - t0)

    figures = {k: summary(v) for k, v in runs.items()}
    say()
    say(f"{'what':<22} {'median':>10} {'range':>21} {'MB/s':>9}   ({a.repeats} runs)")
    labels = {"read_shared_cold": "read, shared, cold", "read_local_cold": "read, local, cold",
              "read_shared_warm": "read, shared, warm", "read_local_warm": "read, local, warm",
              "stage_copy": "stage: the copy", "stage_wall": "stage: with verify",
              "stage_skipped": "stage again (skipped)"}
    for key, label in labels.items():
        f = figures[key]
        rate = "" if key == "stage_skipped" else f"{size / 1e6 / f['median']:,.0f}"
        say(f"{label:<22} {f['median'] * 1000:>8.1f} ms {f['min'] * 1000:>8.1f} - {f['max'] * 1000:>7.1f} ms "
            f"{rate:>9}")
    report = {"tree": name, "bytes": size, "shards": verdict.shards, "params": verdict.params, "shared": str(src),
              "local": str(a.local / name), "df_shared": df(a.shared), "df_local": df(a.local),
              "repeats": a.repeats, "seconds": figures, "machine": platform.node(), "cpus": os.cpu_count(),
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "stage_weights.json").write_text(json.dumps(report, indent=2) + "\n")
        (a.out / "stage_weights.txt").write_text("\n".join(lines) + "\n")
    if not a.keep:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(a.local, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
