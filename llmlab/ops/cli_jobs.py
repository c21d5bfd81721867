"""``llmlab launch | status | metrics | logs | stop | list``: argument parsing and printing over ``llmlab.ops.jobs``.

Kept apart from ``cli.py`` because these commands only make sense on a SLURM login node; the logic is in
``llmlab.ops.jobs``, the plan it submits in ``llmlab.cluster.plan`` (pure: notebook 08 calls it).  A notebook runs
these commands in ``!`` lines, the way a learner types them.  Every command takes ``--json`` where a script or a
grader may read it; errors are one sentence and exit code 2 (1 for a job that FAILED).
"""

from __future__ import annotations

import json
import shlex
import sys
import time

from llmlab import cluster, memory
from llmlab.ops import jobs
from llmlab.serve.vllm import installed_vllm, split_args, vllm_outside_range


def _json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def cmd_launch(a) -> int:
    try:
        extra = split_args(a.extra_vllm_args) if a.extra_vllm_args else None
    except ValueError as e:
        raise cluster.JobError(f"--extra-vllm-args: {e}") from None
    overrides = dict(nodes=a.nodes, gpus_per_node=a.gpus_per_node, gpu=a.gpu_type, tp=a.tp, pp=a.pp,
                     dtype=a.dtype, max_model_len=a.max_model_len, backend=a.backend,
                     expert_parallel=a.expert_parallel or None,
                     extra_args=extra)
    if len(a.model) > 1:
        return cmd_launch_set(a, overrides)
    a.model = a.model[0]
    plan = cluster.prepare(a.model, account=a.account, partition=a.partition, time_limit=a.time,
                           extra_sbatch=a.sbatch or [], command=shlex.join(sys.argv[2:]), share=a.share,
                           share_dir=a.share_dir, rehearse=a.rehearse, **overrides)
    if not a.dry_run:
        jobs.require_slurm("sbatch")  # before the plan: on a laptop, say so first
    check_weights(a, [plan])
    if not a.dry_run and not plan.rehearse:
        check_compute_node(plan)
    if plan.job.engine == "gpu" and (untested := vllm_outside_range(installed_vllm())):
        print(f"warning: {untested}", file=sys.stderr)
    dry = jobs.dry_run_lines(plan)
    if a.json and a.dry_run:
        _json({"plan": plan.report, "script": plan.script, "launcher": dry})
        return 0
    if not a.json:
        against = plan.job.gpu if plan.job.engine == "gpu" else "the CPU engine"
        print(f"Plan for {plan.job.name} (checked against {against}):")
        print(cluster.table(cluster.plan_rows(plan.report)))
        print()
        print(dry.rstrip())
    if a.dry_run:
        print("\n--- job script (not submitted: --dry-run) ---")
        print(plan.script, end="")
        return 0
    record = jobs.launch(plan)
    if a.json:
        _json({"plan": plan.report, **record.as_dict()})
    else:
        print(f"\nsubmitted job {record.job_id}; job script saved as {record.script}")
        print(f"next: llmlab status {record.job_id} --wait")
    return 0


def check_weights(a, plans) -> None:
    """Each plan's weights as its job will load them (``llmlab.ops.preflight``): a submission is refused with the
    sentence; a dry run prints it and goes on, so that the script can still be read."""
    from llmlab.ops import preflight

    for plan in plans:
        problem = None if plan.rehearse else preflight.weights_problem(plan.job, from_hub=a.from_hub)
        if problem and not a.dry_run:
            raise cluster.JobError(problem)
        if problem:
            print(f"warning: the submission would be refused: {problem}", file=sys.stderr)


def check_compute_node(plan) -> None:
    """preflight.compute_node_problem: a refusal stops the submission; otherwise what was found is printed."""
    from llmlab.ops import preflight

    problem, found = preflight.compute_node_problem(plan)
    if problem:
        raise cluster.JobError(problem)
    print(f"pre-flight: {found}", file=sys.stderr)


def cmd_launch_set(a, overrides: dict) -> int:
    """``llmlab launch A B ...``: each model's job as ``llmlab launch A`` would submit it, and the front job that
    routes between them (``llmlab.ops.front``).  A model's layout comes from slurm/models.toml only."""
    from llmlab.cluster.plan import share_directory
    from llmlab.ops import front

    if a.rehearse or any(v is not None for v in overrides.values()):
        raise cluster.JobError("--nodes, --tp, --pp, --gpu-type, --dtype, ... and --rehearse apply to one model: with "
                               "several, each takes its layout from slurm/models.toml (`llmlab list`); launch a model "
                               "alone to change it.")
    command = shlex.join(sys.argv[2:])
    plans = [cluster.prepare(m, account=a.account, partition=a.partition, time_limit=a.time,
                             extra_sbatch=a.sbatch or [], command=command) for m in a.model]
    front.check_set(plans)
    check_weights(a, plans)
    share = (a.share, share_directory(a.share, a.share_dir)) if a.share else None
    options = front.front_options(a.account, a.partition, a.time, plans)
    if a.dry_run:
        script = front.front_script([f"<job of {p.job.name}>" for p in plans], [p.job.name for p in plans],
                                    options, share=share, command=command)
        if a.json:
            _json({"plans": [p.report for p in plans], "scripts": [p.script for p in plans], "front": script})
            return 0
        for plan in plans:
            print(f"Plan for {plan.job.name}:\n{cluster.table(cluster.plan_rows(plan.report))}\n")
        print("--- the front job (not submitted: --dry-run): one endpoint for " + ", ".join(a.model) + " ---")
        print(script, end="")
        return 0
    jobs.require_slurm("sbatch")
    members, router = front.launch_set(plans, options, share=share, command=command)
    if a.json:
        _json({"models": [m.as_dict() for m in members], "front": router.as_dict()})
        return 0
    for m in members:
        print(f"submitted job {m.job_id} ({m.name}); job script {m.script}")
    print(f"submitted job {router.job_id}, the one endpoint for {', '.join(m.name for m in members)} (it starts "
          f"routing once every model answers)\nnext: llmlab status {router.job_id} --wait")
    return 0


class _WaitPrinter:
    """One line per new state; while weights load, a progress bar over the checkpoint shards (n/m, ETA)."""

    def __init__(self):
        self.bar = None

    def __call__(self, st: jobs.JobStatus) -> None:
        shards = (st.progress or {}).get("shards_total")
        if st.state == "LOADING" and shards:
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=shards, desc="loading weights", unit="shard")
            self.bar.n = st.progress["shards_done"]
            self.bar.refresh()
            return
        self.close()
        print(f"[{time.strftime('%H:%M:%S')}] {st.state:<8} {st.detail}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def cmd_status(a) -> int:
    if a.job_id is None and a.wait:
        a.job_id = jobs.latest_job()
    if a.job_id is None:
        rows = jobs.all_status()
        if a.json:
            _json(rows)
        elif not rows:
            print("no llmlab server: start one with `llmlab launch MODEL` (or `llmlab serve` for the embedded one)")
        else:
            for r in rows:
                print(f"{r['job_id']:>10}  {str(r.get('name') or ''):<20} {r['state']:<8} {r['detail']}")
        return 0
    if a.wait:
        printer = None if a.json else _WaitPrinter()
        try:
            st = jobs.wait(a.job_id, timeout=a.timeout, poll=a.poll, on_change=printer)
        finally:
            if printer:
                printer.close()
    else:
        st = jobs.status(a.job_id)
    if a.json:
        _json(st.as_dict())
    elif not a.wait or st.state != "READY":
        print(st)
    else:
        print(f"  use: {st.use}\n  key: {st.api_key_file} (mode 0600)")
    return 1 if st.state == "FAILED" or (a.wait and st.state == "STOPPED") else 0


def cmd_metrics(a) -> int:
    while True:
        mx = jobs.metrics(a.job_id, interval=a.interval)
        if a.json:
            print(json.dumps(mx), flush=True)
        else:
            print(f"[{time.strftime('%H:%M:%S')}] job {a.job_id}, {mx['url']}")
            print(cluster.table(jobs.metrics_rows(mx)), flush=True)
        if not a.watch:
            return 0


def cmd_logs(a) -> int:
    files = jobs.log_files(a.job_id)
    for path in files:
        lines = path.read_text(errors="replace").replace("\r", "\n").splitlines()
        print(f"==> {path} <==")
        print("\n".join(lines[-a.lines:]) if a.lines else "\n".join(lines))
    if not a.follow:
        return 0
    import subprocess

    follow = [str(p) for p in files if p.name == "vllm.log" or p.suffix == ".out"]
    try:
        return subprocess.call(["tail", "-n0", "-F", *follow])
    except KeyboardInterrupt:
        return 0


def cmd_stop(a) -> int:
    st = jobs.stop(a.job_id, timeout=a.timeout)
    if a.json:
        _json(st.as_dict())
    else:
        print(f"job {a.job_id}: {st.state} - {st.detail}; connection file and key removed, Ray and vLLM stopped")
    return 0


def cmd_list(a) -> int:
    rows = jobs.listing()
    if a.json:
        _json(rows)
        return 0
    print(f"{'name':<20} {'layout':<22} {'weights/GPU':>11} {'KV tokens':>11} {'max conc.':>9}  description")
    for r in rows:
        layout = (f"{r['nodes']}x{r['gpus_per_node']} {r['gpu']} TP{r['tp']}xPP{r['pp']}" if r["engine"] == "gpu"
                  else f"{r['nodes']} CPU node(s)")
        weights = "-" if r["weights_gib_per_gpu"] is None else f"{r['weights_gib_per_gpu']:.1f} GiB"
        conc = "-" if r["max_concurrency"] is None else f"{r['max_concurrency']:.1f}"
        print(f"{r['name']:<20} {layout:<22} {weights:>11} {r['kv_tokens']:>11,} {conc:>9}  {r['description']}")
    others = [m for m in memory.shipped_models() if m != "llmlab-tiny" and m not in {r["model"] for r in rows}]
    print(f"\nany other shipped model, laid out by llmlab.memory's planner: {', '.join(others)}"
          "\n(`llmlab launch MODEL --dry-run` shows the layout; --tp/--pp/--gpu-type choose another)")
    return 0


def add_commands(sub) -> None:
    """Register the cluster commands on ``llmlab``'s sub-parser."""
    p = sub.add_parser("launch", help="check a layout, then submit a vLLM server as a SLURM job",
                       description="Per-model defaults come from slurm/models.toml; the layout is checked with "
                       "llmlab.memory before anything is submitted.")
    p.add_argument("model", nargs="+", help="a server of slurm/models.toml (`llmlab list`), e.g. llama3.1-70b, or "
                   "any shipped model (listed by `llmlab list`), laid out by the planner unless --tp/--pp say "
                   "otherwise; several: a job each, and one endpoint in front of them all (llmlab.ops.front)")
    for flag, kind, text in (("--nodes", int, "nodes"), ("--gpus-per-node", int, "GPUs per node"),
                             ("--tp", int, "tensor-parallel size (inside a node)"),
                             ("--pp", int, "pipeline-parallel size (one stage per node)"),
                             ("--max-model-len", int, "context length served")):
        p.add_argument(flag, type=kind, help=text)
    p.add_argument("--gpu-type", help="the GPU the plan is checked against: H100-80, A100-40, H200-141, custom:<GiB>")
    p.add_argument("--backend", choices=("ray", "mp"), help="across nodes: Ray's executor (token-authenticated; the "
                   "default) or vLLM's own processes (--nnodes, no Ray: their unauthenticated ports carry the "
                   "prompts; only where a firewall keeps other users off the nodes, see docs/security.md)")
    p.add_argument("--dtype", help="weight dtype for vLLM: bfloat16, float16, fp8 ...")
    p.add_argument("--expert-parallel", action="store_true", help="a mixture of experts: deal whole experts out to "
                   "the TP group's GPUs (vLLM's --enable-expert-parallel)")
    p.add_argument("--extra-vllm-args", help="more vllm serve flags, quoted as one string")
    p.add_argument("--account", help="SLURM account (else sbatch's default / SBATCH_ACCOUNT)")
    p.add_argument("--partition", help="SLURM partition (else sbatch's default / SBATCH_PARTITION)")
    p.add_argument("--time", help="time limit, e.g. 04:00:00 (default: the model's job script)")
    p.add_argument("--sbatch", action="append", metavar="OPTION", help="one more sbatch option, e.g. "
                   "--sbatch=--constraint=h100 (repeatable)")
    p.add_argument("--share", metavar="GROUP", help="a workshop server: members of this UNIX group may use it, each "
                   "with a key of their own (docs/workshop.md)")
    p.add_argument("--share-dir", metavar="DIR", help="where learners find it (default $LLMLAB_SHARE_ROOT/GROUP)")
    p.add_argument("--rehearse", action="store_true", help="run `llmlab rehearse` on the layout in the allocation "
                   "(dummy weights: memory and speed before downloading the real ones)")
    p.add_argument("--from-hub", action="store_true", help="serve the model's Hugging Face id, downloaded in the job "
                   "into $HF_HOME (without it, a GPU job needs LLMLAB_MODEL_DIR or LLMLAB_MODEL_PATH, checked first)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the job script; submit nothing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("status", help="PENDING / STARTING / LOADING / READY / FAILED / STOPPED of llmlab servers")
    p.add_argument("job_id", nargs="?", help="a job id (default: every llmlab server of yours; with --wait, "
                   "the newest job you launched)")
    p.add_argument("--wait", action="store_true", help="block until READY (exit 0) or FAILED (exit 1)")
    p.add_argument("--timeout", type=float, default=7200, help="seconds --wait waits")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between checks")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("metrics", help="requests, KV-cache use, tokens/s and latencies from the server's /metrics")
    p.add_argument("job_id", help="a job id, or 'embedded'")
    p.add_argument("--watch", action="store_true", help="print again every --interval seconds (Ctrl-C stops)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between the two scrapes of a rate")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_metrics)

    p = sub.add_parser("logs", help="the job's output, vLLM's log and Ray's logs")
    p.add_argument("job_id")
    p.add_argument("-n", "--lines", type=int, default=40, help="last lines of each file (0: all)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines (Ctrl-C stops)")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("stop", help="scancel a server and confirm that it is gone")
    p.add_argument("job_id")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("revoke", help="shut one learner out of a shared server (it keeps running); --undo gives them "
                                      "back")
    p.add_argument("job_id")
    p.add_argument("user", help="the learner's user name")
    p.add_argument("--undo", action="store_true", help="give back a learner revoked by mistake")
    p.set_defaults(func=lambda a: print(jobs.revoke(a.job_id, a.user, undo=a.undo)) or 0)

    p = sub.add_parser("list", help="the shipped server settings and their checked plans")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)
