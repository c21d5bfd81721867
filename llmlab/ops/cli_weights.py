"""``llmlab weights plan / fetch / verify / stage / unstage``: a thin shell over :mod:`llmlab.ops.weights`.

Arguments and printing here, the logic there.  Exit codes: 0 done (or nothing wrong), 1 ``verify`` found a
problem, 2 an expected failure (gated model, no network, no space, not a model folder) said in one sentence.
"""

from __future__ import annotations

import json
import sys


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:,.2f} GB"


def _print_plan(p: dict) -> None:
    how = "as on disk" if p["exact"] else ("an estimate: llmlab.memory's parameter count x the checkpoint's dtype, "
                                           "in shards of up to 5 GB")
    quant = f", {p['quantization']} quantized" if p["quantization"] else ""
    lines = [f"model        {p['model']} ({p['architecture']}{', ' + p['repo'] if p.get('repo') else ''})",
             f"parameters   {p['params']:,} (llmlab.memory, from the config)",
             f"dtype        {p['dtype']}{quant}",
             f"weights      {_gb(p['bytes'])} in {p['shards']} safetensors shard(s) ({how})"]
    if p.get("index_total_size"):
        lines.append(f"index        total_size {p['index_total_size']:,} bytes of tensor data")
    if p["exact"]:
        shown = p["files"][:12]
        lines += [f"  {f['name']}  {f['bytes']:,} bytes" for f in shown]
        if len(p["files"]) > len(shown):
            lines.append(f"  ... and {len(p['files']) - len(shown)} more")
    else:
        names = [f["name"] for f in p["files"]]
        lines.append(f"files        {names[0]}" + (f" ... {names[-2]}, {names[-1]}" if len(names) > 1 else "")
                     + ", config.json, tokenizer files (the repository's own split may differ by a shard)")
    if "to" in p:
        verdict = "fits" if p["fits"] else f"does NOT fit: {_gb(p['bytes'] - p['free_bytes'])} short"
        lines.append(f"disk         {_gb(p['bytes'])} needed in {p['to']}; {_gb(p['free_bytes'])} free on "
                     f"{p['free_on']}: {verdict}")
        lines.append(f"quota        the free bytes are the file system's; yours may be less: {p['quota_command']}")
    else:
        lines.append(f"disk         {_gb(p['bytes'])} needed (--to DIR says whether it fits there)")
    print("\n".join(lines))


def _print_verdict(v: dict) -> None:
    count = (f"{v['params']:,} parameters" + ("" if v["expected_params"] is None else
             f" ({'=' if v['params'] == v['expected_params'] else '!='} llmlab.memory's {v['expected_params']:,})"))
    dtypes = ", ".join(v["dtypes"]) or "-"
    print(f"{v['root']}: {v['shards']} shard(s), {v['bytes'] / 1e6:,.1f} MB, {count}, dtype {dtypes}")
    for note in v["notes"]:
        print(f"note: {note}")
    for problem in v["problems"]:
        print(f"PROBLEM: {problem}")
    print("verified: no problem found" if v["ok"] else f"{len(v['problems'])} problem(s)")


def cmd_weights(args) -> int:
    from llmlab import memory
    from llmlab.ops import weights

    try:
        if args.action == "plan":
            report = weights.plan(args.model, args.to)
            print(json.dumps(report, indent=2)) if args.json else _print_plan(report)
            return 0 if report.get("fits", True) else 1
        if args.action == "verify":
            verdict = weights.verify(args.model).as_dict()
            print(json.dumps(verdict, indent=2)) if args.json else _print_verdict(verdict)
            return 0 if verdict["ok"] else 1
        if args.action == "fetch":
            report = weights.fetch(args.model, args.to, group=args.group, revision=args.revision,
                                   say=(lambda *a, **k: None) if args.json else print)
            if args.json:
                print(json.dumps(report, indent=2))
            else:
                print(f"fetched {report['repo']} into {report['to']} in {report['seconds']:.1f} s; modes: "
                      f"{report['modes']}")
                _print_verdict(report["verify"])
            return 0 if report["verify"]["ok"] else 1
        quiet = (lambda *a, **k: None) if args.json else print
        if args.action == "unstage":
            report = weights.unstage(args.model, say=quiet)
        else:
            report = weights.stage(args.model, args.to, progress=not args.json, say=quiet)
        if args.json:
            print(json.dumps(report, indent=2))
        return 0
    except (weights.WeightsError, memory.ConfigError) as e:
        print(f"llmlab weights {args.action}: {e}", file=sys.stderr)
        return 2


def add_commands(sub) -> None:
    p = sub.add_parser("weights", help="plan, fetch, verify, stage and unstage a model's weights",
                       description="A model's weights before the room needs them: plan (files, bytes, disk), fetch "
                       "(huggingface_hub, resumable, group-readable), verify (shards, headers, sizes, parameter "
                       "count, modes), stage (a timed copy to node-local disk), unstage (remove such a copy).")
    acts = p.add_subparsers(dest="action", required=True)
    a = acts.add_parser("plan", help="files, bytes and dtype; with --to, whether it fits there")
    a.add_argument("model", help="a model folder, a shipped name (llama3.1-70b, ...) or its Hugging Face id")
    a.add_argument("--to", metavar="DIR", help="where it would go: says the free space there and if it fits")
    a.add_argument("--json", action="store_true")
    a = acts.add_parser("fetch", help="download the files vLLM reads (huggingface_hub, resumable) into DIR")
    a.add_argument("model", help="a Hugging Face id (meta-llama/Llama-3.1-70B-Instruct) or a shipped name")
    a.add_argument("--to", metavar="DIR", required=True, help="the model's folder (e.g. $LLMLAB_MODEL_DIR/NAME)")
    a.add_argument("--group", help="the UNIX group that reads it (default: the folder's own); folders 2750, files "
                   "0640")
    a.add_argument("--revision", help="a branch, tag or commit of the repository (default: main)")
    a.add_argument("--json", action="store_true")
    a = acts.add_parser("verify", help="shards, sizes, headers, parameter count, dtype and modes; exit 1 on a "
                        "problem")
    a.add_argument("model", metavar="DIR", help="a model folder")
    a.add_argument("--json", action="store_true")
    a = acts.add_parser("stage", help="copy a model folder to node-local disk (timed; skipped if already there)")
    a.add_argument("model", metavar="DIR", help="the model folder on the shared file system")
    a.add_argument("--to", metavar="LOCAL", required=True, help="node-local folder; the copy is LOCAL/<DIR's name>")
    a.add_argument("--json", action="store_true")
    a = acts.add_parser("unstage", help="remove a copy that stage made (its private manifest proves it), and "
                        "nothing else")
    a.add_argument("model", metavar="COPY", help="the staged copy, LOCAL/<name> (e.g. /local/scratch/$USER/weights/"
                   "Llama-3.1-70B-Instruct)")
    a.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_weights)
