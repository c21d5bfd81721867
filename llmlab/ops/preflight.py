"""What ``llmlab launch`` checks before ``sbatch``: the served weights, and that a compute node sees the files.

Why here and not in the job: a GPU job waits in the queue, then loads for minutes, before a missing folder or a
truncated shard shows in its log, on the morning of a workshop.  And a GPU job whose launch shell lacked
``LLMLAB_MODEL_DIR`` serves the Hugging Face id, which means a 141 GB download into ``$HF_HOME`` on the GPU node
(or a failure where compute nodes have no network), with no word at launch (instructor-review-3, the day's launch).
The weights are read the way ``llmlab weights verify`` reads them: the index and every shard's header, a few MB
for a 70B, never the tensors.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from llmlab import memory
from llmlab.cluster.layouts import JobSettings, slurm_dir
from llmlab.cluster.render import model_path
from llmlab.ops import weights


def loads_nothing(job: JobSettings, extra_args: list[str] = ()) -> bool:
    """Dummy weights (``--load-format dummy``: rehearsals and the GPU benchmarks) read no checkpoint."""
    args = [*job.extra_args, *extra_args]
    return any(a == "--load-format=dummy" or (a == "--load-format" and args[i + 1:i + 2] == ["dummy"])
               for i, a in enumerate(args))


def weights_problem(job: JobSettings, env: dict | None = None, *, from_hub: bool = False) -> str | None:
    """Why this GPU job's weights would fail it once it runs, in one sentence with the fix; None if they pass.

    ``from_hub``: the instructor asked for a download in the job (``llmlab launch --from-hub``)."""
    env = dict(os.environ if env is None else env)
    if job.engine != "gpu" or loads_nothing(job, _split(env.get("LLMLAB_EXTRA_VLLM_ARGS", ""))):
        return None
    path = model_path(job, env)
    hf_id = memory.HF_IDS.get(job.model, job.model)
    if path == hf_id and not Path(path).is_dir():
        if from_hub:
            return None
        return (f"{job.name} would load {hf_id} from the Hugging Face hub: the job would download it into "
                f"{env.get('HF_HOME') or '~/.cache/huggingface'} on the GPU node (or fail where compute nodes have no "
                "network), because neither LLMLAB_MODEL_DIR nor LLMLAB_MODEL_PATH is set in this shell. Export "
                "LLMLAB_MODEL_DIR=<the folder `llmlab weights fetch` filled> and launch again, or pass --from-hub "
                "to download in the job.")
    verdict = weights.verify(path, group=False)
    if verdict.ok:
        return None
    more = f" (and {len(verdict.problems) - 1} more: `llmlab weights verify {path}` lists them)" \
        if len(verdict.problems) > 1 else ""
    first = verify_sentence(verdict.problems[0], hf_id)
    return f"{job.name} would load {path}, which does not pass `llmlab weights verify`: {first}{more}"


def verify_sentence(problem: str, hf_id: str) -> str:
    """``verify``'s sentence with the repository filled in: a folder never fetched has no record of its repository,
    and verify then writes REPO in the command it gives; the launcher knows the job's."""
    return problem.replace("llmlab weights fetch REPO ", f"llmlab weights fetch {hf_id} ")


def _split(line: str) -> list[str]:
    from llmlab.serve.vllm import split_args

    try:
        return split_args(line)
    except ValueError:  # render() refuses it with its own sentence
        return []


SRUN_WAIT = 30  # seconds srun may wait for a node before the check says it could not run (--immediate)


def needed_paths(plan, env: dict | None = None) -> list[str]:
    """What the job reads on its nodes, by absolute path: the checkout's slurm/ folder, the job's Python, the share
    folder, and the weights folder (when it is one)."""
    env = dict(os.environ if env is None else env)
    paths = [str(slurm_dir()), env.get("LLMLAB_PYTHON") or sys.executable]
    if plan.share:
        paths.append(str(plan.share[1]))
    if plan.job.engine == "gpu" and Path(weights_path := model_path(plan.job, env)).is_absolute():
        paths.append(weights_path)
    return paths


def compute_node_problem(plan, env: dict | None = None) -> tuple[str | None, str]:
    """(a refusal, or None; what was found) from a one-second ``srun`` on a node of the job's partition that looks
    for :func:`needed_paths`.  Why: the job script names them by absolute path, so they must be on a file system the
    compute nodes mount; a home or /tmp of the login node is not, and the job would fail after its wait in the
    queue.  A partition with no node free within SRUN_WAIT seconds (or one that refuses a job without GPUs) cannot
    be checked: that is said, not refused."""
    paths = needed_paths(plan, env)
    options = [f"--{k}={v}" for k, v in plan.sbatch_options.items() if k in ("account", "partition")]
    cmd = ["srun", f"--immediate={SRUN_WAIT}", "--nodes=1", "--ntasks=1", "--time=1", "--quiet", *options,
           "sh", "-c", 'for p; do [ -e "$p" ] || echo "$p"; done', "sh", *paths]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=SRUN_WAIT + 30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"not checked from a compute node ({e})"
    if res.returncode:
        why = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
        return None, (f"not checked from a compute node ({why}): make sure {', '.join(paths)} are on a file "
                      "system the compute nodes mount")
    missing = res.stdout.split()
    if missing:
        return (f"A compute node of this job's partition does not see {', '.join(missing)}: the job names them by "
                "absolute path, so put them (the checkout, its environments, the share and weights folders) on a "
                "file system every login and compute node mounts, and launch again."), ""
    return None, f"a compute node sees {', '.join(paths)}"

