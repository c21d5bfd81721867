"""The package's floors: lessons on top of ``llmlab.serve``, ``llmlab.ops`` on top of both, and no circle.

Why: a learner opens ``llmlab/`` and should find their lessons, with the machinery below them (``serve/``) and
the tools that drive them beside (``ops/``).  That only stays true if the arrows keep pointing one way, so this
walks every import in the package, those inside functions too (they are real dependencies), and fails on an
arrow up a floor or on any circle, naming it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "llmlab"
FLOOR = {"serve": 0, "lesson": 1, "ops": 2}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def floor(module: str) -> int | None:
    parts = module.split(".")
    if module in ("llmlab", "llmlab.__main__"):
        return None  # the front door: `import llmlab` and `python -m llmlab` may point anywhere
    if parts[1] in ("serve", "ops"):
        return FLOOR[parts[1]] if len(parts) > 2 else None
    return FLOOR["lesson"]


def imports_of(module: str) -> set[str]:
    """The llmlab modules ``module`` imports, at any depth of its code (``from llmlab import x`` -> ``llmlab.x``)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("llmlab")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmlab"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
    return {m for m in found if m in MODULES and m != module}


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_arrow_points_down_a_floor_or_along_it():
    up = [f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})" for a, targets in GRAPH.items() for b in targets
          if floor(a) is not None and floor(b) is not None and floor(b) > floor(a)]
    assert not up, "arrows up a floor:\n" + "\n".join(up)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    # the package's own __init__ is left out: every `import llmlab.x` runs it, which is not a dependency of x
    graph = {m: {t for t in ts if t != "llmlab"} for m, ts in GRAPH.items() if m != "llmlab"}
    assert not cycles(graph), f"import circles: {cycles(graph)}"


def test_the_walk_sees_a_circle_and_an_upward_arrow():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert floor("llmlab.serve.proxy") < floor("llmlab.memory") < floor("llmlab.ops.jobs")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("llmlab.serve.")))
def test_serve_imports_no_lesson(module):
    lessons = [t for t in GRAPH[module] if floor(t) == FLOOR["lesson"]]
    assert not lessons, f"{module} imports the lesson module(s) {lessons}"


# --- the proxy: its security perimeter is a floor of its own (issue 49) ------------------------------------------

PROXY_FLOORS = ["answers", "keys", "policy", "limits", "router", "relay", "command"]


def test_the_proxys_modules_stand_on_the_ones_below_them_only():
    """answers < keys < policy < limits, router < relay < command: the perimeter (keys, policy, limits) never
    imports the router or the connections, so a security reading stops at ``policy``/``limits``/``keys``."""
    level = {f"llmlab.serve.proxy.{m}": i for i, m in enumerate(PROXY_FLOORS)}
    level["llmlab.serve.proxy.router"] = level["llmlab.serve.proxy.limits"]  # side by side: neither needs the other
    assert set(level) | {"llmlab.serve.proxy", "llmlab.serve.proxy.__main__"} == {
        m for m in MODULES if m.startswith("llmlab.serve.proxy")}, "a proxy module is missing from PROXY_FLOORS"
    up = [f"{a} imports {b}" for a in level for b in GRAPH[a] if b in level and level[b] >= level[a]]
    assert not up, "the proxy's arrows must point down:\n" + "\n".join(up)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if floor(m) == FLOOR["lesson"]))
def test_a_lesson_imports_only_the_proxys_router_and_command(module):
    inner = sorted(t for t in GRAPH[module] if t.startswith("llmlab.serve.proxy")
                   and t not in ("llmlab.serve.proxy.router", "llmlab.serve.proxy.command"))
    assert not inner, f"{module} imports the proxy's {inner}: lessons use its router and its command only"



def test_vllms_metric_names_are_spelled_in_one_module():
    """One vocabulary (issue 49): a "vllm:..." metric name is written in llmlab/serve/metrics.py only, so a name
    vLLM renames is changed once and every lesson, `llmlab top` and `llmlab metrics` follow."""
    spelled = sorted(f"{m}: {node.value}" for m, path in MODULES.items() if m != "llmlab.serve.metrics"
                     for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Constant) and isinstance(node.value, str)
                     and node.value.startswith("vllm:") and " " not in node.value)
    assert not spelled, "vLLM metric names outside llmlab.serve.metrics:\n" + "\n".join(spelled)


# vLLM's counters and histograms (llmlab/serve/metrics.py's names): they only grow, so a lesson subtracts two scrapes
COUNTED = {"PROMPT_TOKENS", "PROMPT_BY_SOURCE", "GENERATED", "FINISHED", "PREFIX_QUERIES", "PREFIX_HITS", "PREEMPTIONS",
           "REQUEST_PREEMPTIONS", "STEPS", "DRAFTS", "DRAFT_TOKENS", "ACCEPTED", "ACCEPTED_AT", "TTFT", "ITL", "E2E",
           "PREFILL_COMPUTED"}


def test_a_lesson_reads_vllms_counters_through_the_one_snapshot_type():
    """One snapshot type (issue 49): every lesson that subtracts counters reads them as
    ``llmlab.serve.metrics.Counters`` (``after - before``), so none picks a counter out of a scrape itself --
    ``m.value(GENERATED)``, ``m[STEPS + "_bucket"]`` or ``histogram(m, ITL)`` -- and subtracts it its own way."""
    def named(node) -> str | None:
        node = node.left if isinstance(node, ast.BinOp) else node  # STEPS + "_count"
        return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None

    found = []
    for m, path in MODULES.items():
        if floor(m) != FLOOR["lesson"]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            picked = (isinstance(node, ast.Call) and node.args and named(node.args[-1 if named(node.func) ==
                      "histogram" else 0]) in COUNTED and named(node.func) in ("value", "histogram")) or (
                isinstance(node, ast.Subscript) and named(node.slice) in COUNTED)
            if picked:
                found.append(f"{m}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "counters read outside llmlab.serve.metrics.Counters:\n" + "\n".join(found)


# --- the cluster lesson: a job's settings are decided in one module, which calls nothing back (issue 49) ---------

def test_a_jobs_settings_are_called_and_call_no_cluster_module_back():
    """``cluster.layouts`` holds a job's settings from models.toml to the checked layout (read, changed by the
    caller, checked, reported) and imports no other cluster module; no cluster module imports ``plan`` (the job
    script), which only the package's face and the tools call.  So a launch's settings are decided in one file
    and the arrows between the lesson's files point one way: plan, render -> layouts."""
    inside = {m: sorted(t for t in GRAPH[m] if t.startswith("llmlab.cluster.")) for m in MODULES
              if m.startswith("llmlab.cluster.")}
    assert inside["llmlab.cluster.layouts"] == [], f"layouts imports {inside['llmlab.cluster.layouts']}"
    back = sorted(m for m, ts in inside.items() if "llmlab.cluster.plan" in ts)
    assert not back, f"{back} import llmlab.cluster.plan: the job script is called by the tools, not by the lesson"


# --- the notebooks: a learner who follows an import lands in a lesson module -------------------------------------

NOTEBOOK_ROOT = PACKAGE.parent


def notebook_imports(path: Path) -> set[str]:
    """The llmlab modules a notebook's code cells import (shell and magic lines left out: what a cluster's learner
    does there, ``!llmlab launch ...``, is the ``llmlab`` command, not an import)."""
    import json

    found = set()
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines())
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("llmlab")}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmlab"):
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                          for a in node.names}
    return found


NOTEBOOKS = sorted(str(p.relative_to(NOTEBOOK_ROOT)) for part in ("notebooks", "solutions", "exercises")
                   for p in (NOTEBOOK_ROOT / part).glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebooks_import_lessons_not_the_machinery(notebook):
    machinery = {m for m in notebook_imports(NOTEBOOK_ROOT / notebook)
                 if m.split(".")[1:2] in (["ops"], ["serve"])}
    assert not machinery, (f"{notebook} imports {sorted(machinery)}: reach it through a lesson module, or, for "
                           "what a learner does on a cluster, the llmlab command in a ! line")
