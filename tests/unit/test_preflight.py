"""``llmlab launch``'s checks before ``sbatch`` (llmlab.ops.preflight; issue 47, the instructor's day): a GPU job
whose weights would fail it is refused on the login node, in one sentence with the fix, not minutes into its run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from llmlab import cluster, memory
from llmlab.ops import preflight
from llmlab.ops.cli_jobs import check_weights

TINY = memory.MODELS_DIR / memory.TINY_NAME
CLEAN = {"LLMLAB_MODEL_PATH": "", "LLMLAB_MODEL_DIR": "", "LLMLAB_STAGE_DIR": "", "LLMLAB_CACHE_DIR": ""}


def job(name: str = "llama3.1-8b", **overrides):
    return cluster.settings(name, **overrides)


def test_a_gpu_job_with_no_weights_folder_in_its_shell_is_refused_before_sbatch_unless_the_hub_is_asked_for(
        monkeypatch):
    for name in CLEAN:
        monkeypatch.delenv(name, raising=False)
    problem = preflight.weights_problem(job(), {})
    assert "meta-llama/Llama-3.1-8B-Instruct from the Hugging Face hub" in problem
    assert "LLMLAB_MODEL_DIR" in problem and "--from-hub" in problem
    assert preflight.weights_problem(job(), {}, from_hub=True) is None
    plans = [cluster.prepare("llama3.1-8b")]
    with pytest.raises(cluster.JobError, match="from the Hugging Face hub"):
        check_weights(Namespace(from_hub=False, dry_run=False), plans)
    check_weights(Namespace(from_hub=True, dry_run=False), plans)


def test_a_missing_or_broken_weights_folder_is_refused_naming_the_folder_and_the_command_that_fixes_it(tmp_path):
    missing = preflight.weights_problem(job(), {"LLMLAB_MODEL_DIR": str(tmp_path)})
    assert f"{tmp_path}/Llama-3.1-8B-Instruct is not a folder" in missing
    assert "llmlab weights fetch meta-llama/Llama-3.1-8B-Instruct --to" in missing  # the job's repository, not REPO
    folder = tmp_path / "Llama-3.1-8B-Instruct"
    shutil.copytree(TINY, folder)
    assert preflight.weights_problem(job(), {"LLMLAB_MODEL_DIR": str(tmp_path)}) is None  # a tree verify passes
    shard = folder / "model.safetensors"
    with open(shard, "r+b") as f:  # a download cut short
        f.truncate(shard.stat().st_size // 2)
    broken = preflight.weights_problem(job(), {"LLMLAB_MODEL_PATH": str(folder)})
    assert "does not pass `llmlab weights verify`" in broken and f"{shard} is truncated" in broken


def test_dummy_weights_and_cpu_jobs_need_no_folder():
    assert preflight.weights_problem(job(extra_args=["--load-format", "dummy"]), {}) is None
    assert preflight.weights_problem(job(), {"LLMLAB_EXTRA_VLLM_ARGS": "--load-format=dummy"}) is None
    assert preflight.weights_problem(cluster.settings("llmlab-tiny-cpu"), {}) is None


def test_a_dry_run_says_the_submission_would_be_refused_and_the_script_records_the_weights_settings(tmp_path):
    env = {**CLEAN, "LLMLAB_MODEL_DIR": str(tmp_path / "models"), "LLMLAB_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "llmlab", "launch", "llama3.1-8b", "--dry-run"],
                         capture_output=True, text=True, env={**_environ(), **env}, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "warning: the submission would be refused: llama3.1-8b would load" in out.stderr
    assert f"export LLMLAB_MODEL_DIR={tmp_path / 'models'}" in out.stdout
    assert f"export LLMLAB_CACHE_DIR={tmp_path / 'cache'}" in out.stdout
    assert "LLMLAB_STAGE_DIR" not in out.stdout.split("--- job script")[1]  # unset: not written


def _environ() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k not in CLEAN}


def test_the_shipped_tiny_model_is_a_tree_that_verify_passes():
    """The fixture the tests above lean on: if it stops passing, they test nothing."""
    assert Path(TINY).is_dir() and preflight.weights.verify(TINY, group=False).ok
