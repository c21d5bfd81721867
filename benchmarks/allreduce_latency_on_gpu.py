"""What one NCCL all-reduce costs between two GPUs of one host, by message size: the measurement behind lesson 08's
fixed cost per all-reduce (``allreduce_latency_us`` of ``llmlab.cluster.tp_vs_pp``), which the lesson quotes for
an 8 KiB message (one token's hidden state of a 4096-wide model in bf16).

    python benchmarks/allreduce_latency_on_gpu.py --out DIR        # two GPUs; spawns one process per GPU
    python benchmarks/allreduce_latency_on_gpu.py --out DIR --graph-ops 0     # eager sizes only
    python benchmarks/allreduce_latency_on_gpu.py --out DIR --graph-only      # the CUDA graph only

On the course's lent machines (torch is in their python3): the same line, on a kind with two GPUs.

Two processes (``torch.multiprocessing``), an NCCL process group, NVLink multicast off (the lending workplace asks
it; the variables of ``benchmarks/rehearse_on_device.sh``). For each size of bf16 message: warm-up, then per round
``--iters`` all-reduces timed two ways -- CUDA events around each op, enqueued back to back (the GPU's time per op
where launches keep ahead of it; for small messages they don't, and the gaps between launches count too), and the
host's wall clock per op with ``torch.cuda.synchronize()`` after each (what a caller waiting for the result sees:
launch + transfer + sync, the per-message fixed cost). Median and p10/p90 in µs over all rounds, and the bus
bandwidth from the event median (for two ranks bus = algorithm bandwidth, bytes / time). Then the 8 KiB all-reduce
captured in a CUDA graph (``torch.cuda.graph``, ``--graph-ops`` all-reduces per graph) and replayed, timed with events
per replay: the per-op cost once launches are out of the way, as in vLLM's graph-replayed decode steps. After a
capture the workers leave with ``os._exit``: ``destroy_process_group`` hangs then (pytorch/pytorch#115388). Rank 0
prints the table and writes ``DIR/allreduce.txt`` (the table, headed by the command, card, driver, versions and
time) and ``DIR/allreduce.json`` (every figure, both ranks). Not part of llmlab: a benchmark, run by hand.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the lending workplace's settings (benchmarks/rehearse_on_device.sh): NVLink multicast stays off
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
SIZES = {"8 B": 8, "1 KiB": 1 << 10, "8 KiB": 8 << 10, "64 KiB": 64 << 10, "1 MiB": 1 << 20, "16 MiB": 16 << 20}
WORLD = 2


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summary(us: list[float]) -> dict:
    return {"median_us": round(statistics.median(us), 2), "p10_us": round(pct(us, 0.1), 2),
            "p90_us": round(pct(us, 0.9), 2), "n": len(us)}


def worker(rank: int, port: int, args: argparse.Namespace, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            device_id=dev, timeout=datetime.timedelta(seconds=120))
    check = torch.full((4096,), rank + 1.0, dtype=torch.bfloat16, device=dev)
    dist.all_reduce(check)
    torch.cuda.synchronize()
    assert torch.all(check == 3.0).item(), "all-reduce gave a wrong sum"
    rows = {}
    for name, nbytes in SIZES.items() if not args.graph_only else ():
        x = torch.zeros(max(1, nbytes // 2), dtype=torch.bfloat16, device=dev)  # zeros: sums stay finite
        event_us, wall_us, rounds = [], [], []
        for _ in range(args.rounds):
            for _ in range(args.warmup):
                dist.all_reduce(x)
            torch.cuda.synchronize()
            dist.barrier()
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
            for s, e in zip(starts, ends, strict=True):
                s.record()
                dist.all_reduce(x)
                e.record()
            torch.cuda.synchronize()
            ev = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)]
            dist.barrier()
            wall = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                dist.all_reduce(x)
                torch.cuda.synchronize()
                wall.append((time.perf_counter() - t0) * 1e6)
            event_us += ev
            wall_us += wall
            rounds.append({"event_median_us": round(statistics.median(ev), 2),
                           "wall_median_us": round(statistics.median(wall), 2)})
        ev_sum = summary(event_us)
        rows[name] = {"bytes": x.numel() * 2, "event": ev_sum, "wall": summary(wall_us), "rounds": rounds,
                      # two ranks: bus bandwidth = algorithm bandwidth * 2 (n - 1) / n = bytes / time
                      "busbw_GBps": round(x.numel() * 2 / (ev_sum["median_us"] * 1e-6) / 1e9, 2)}
        del x
    if rank == 0:  # the eager figures, before the graph capture (which could hang) is tried
        print(json.dumps(rows), flush=True)
    graph = None
    try:  # the 8 KiB all-reduce captured in a CUDA graph and replayed
        if not args.graph_ops:
            raise RuntimeError("skipped (--graph-ops 0)")
        x = torch.zeros(SIZES["8 KiB"] // 2, dtype=torch.bfloat16, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(10):
                dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        # thread_local: c10d's watchdog thread may query events while this thread captures
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for _ in range(args.graph_ops):
                dist.all_reduce(x)
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
        dist.barrier()
        replays = max(20, args.iters // args.graph_ops * 10)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        for s, e in zip(starts, ends, strict=True):
            s.record()
            g.replay()
            e.record()
        torch.cuda.synchronize()
        per_op = [s.elapsed_time(e) * 1e3 / args.graph_ops for s, e in zip(starts, ends, strict=True)]
        graph = {"ops_per_graph": args.graph_ops, "replays": replays, "event_per_op": summary(per_op)}
    except Exception as exc:  # capture is a bonus: keep the eager figures if it fails
        graph = {"error": f"{type(exc).__name__}: {exc}"}
    dist.barrier()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps({"sizes": rows, "graph_8KiB": graph}))
    if "error" not in graph:  # destroy_process_group hangs after a captured NCCL op (pytorch/pytorch#115388)
        os._exit(0)
    dist.destroy_process_group()


def sh(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
        return re.sub(r"\x1b\[[0-9;]*m", "", out).strip()  # nvidia-smi topo underlines its header
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({argv[0]}: {exc})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for allreduce.txt and allreduce.json")
    p.add_argument("--iters", type=int, default=2000, help="timed all-reduces per size and round (each way)")
    p.add_argument("--warmup", type=int, default=200, help="all-reduces before each round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--graph-ops", type=int, default=50,
                   help="8 KiB all-reduces captured in one CUDA graph (0: no graph)")
    p.add_argument("--graph-only", action="store_true", help="only the CUDA graph, no eager sizes")
    args = p.parse_args()
    os.environ.update(NO_MULTICAST)
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < WORLD:
        raise SystemExit(f"needs {WORLD} GPUs, this machine has {torch.cuda.device_count()}: run it on a host "
                         "with two (a kind with x2 on the course's lent machines)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(port, args, tmp), nprocs=WORLD, join=True)
        results = {r: json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)}
    r0 = results[0]
    head = [
        "$ " + " ".join([Path(sys.executable).name, *sys.argv]),
        f"card     {WORLD} x {torch.cuda.get_device_name(0)}, driver "
        + sh(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()[0],
        f"software torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
        f"Python {platform.python_version()}",
        "env      " + " ".join(f"{k}={v}" for k, v in NO_MULTICAST.items()),
        f"time     {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M:%S UTC')}",
        f"method   bf16, {args.rounds} rounds x {args.iters} ops per size and way, {args.warmup} warm-up per round; "
        "rank 0's figures",
        "",
        f"{'size':>8} {'event µs p50':>13} {'p10-p90':>15} {'wall µs p50':>12} {'p10-p90':>15} {'bus GB/s':>9}",
    ]
    for name, row in r0["sizes"].items():
        ev, wa = row["event"], row["wall"]
        head.append(f"{name:>8} {ev['median_us']:>13.2f} {ev['p10_us']:>7.2f}-{ev['p90_us']:<7.2f} "
                    f"{wa['median_us']:>12.2f} {wa['p10_us']:>7.2f}-{wa['p90_us']:<7.2f} {row['busbw_GBps']:>9.2f}")
    if "8 KiB" in r0["sizes"]:
        rounds = r0["sizes"]["8 KiB"]["rounds"]
        head.append("8 KiB per round (event · wall p50): "
                    + ", ".join(f"{r['event_median_us']:.2f} · {r['wall_median_us']:.2f}" for r in rounds))
    r1 = results.get(1, {}).get("sizes", {}).get("8 KiB")
    if r1:
        head.append(f"8 KiB on rank 1 (event · wall p50): {r1['event']['median_us']:.2f} · "
                    f"{r1['wall']['median_us']:.2f}")
    g = r0["graph_8KiB"]
    if "error" in g:
        head.append(f"8 KiB in a CUDA graph: failed ({g['error']})")
    else:
        e = g["event_per_op"]
        head.append(f"8 KiB in a CUDA graph ({g['ops_per_graph']} per graph, {g['replays']} replays, events per "
                    f"replay / ops): {e['median_us']:.2f} µs per op (p10-p90 {e['p10_us']:.2f}-{e['p90_us']:.2f})")
    topo = sh(["nvidia-smi", "topo", "-m"])
    text = "\n".join(head) + "\n\nnvidia-smi topo -m:\n" + topo + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "allreduce.txt").write_text(text)
    meta = {"command": head[0][2:], "card": torch.cuda.get_device_name(0), "gpus": WORLD,
            "driver": head[1].rsplit("driver ", 1)[1], "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "env": NO_MULTICAST, "time_utc": head[4][9:],
            "dtype": "bfloat16", "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
            "topology": topo}
    (args.out / "allreduce.json").write_text(json.dumps({**meta, "ranks": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
