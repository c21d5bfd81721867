"""Every figure a lesson calls measured names where it comes from (CONVENTIONS.md; issue 48, item 5).

The rule, precise enough to check:

- A *paragraph* is a markdown cell's block between blank lines; each item of a markdown list is its own paragraph.
- A sentence *calls a figure measured* when it holds the word "measured" or "measurement(s)" and a number with a
  unit (ms, µs, s, tokens/s, GB/s, TB/s, TFLOP/s, GiB, GB, MiB, MB, %, or a factor such as 1.40x) outside
  backticks, unless it says the opposite ("not measured", "not a measurement", "not measurements", "no run has
  measured").
- Such a sentence passes when the figure is someone else's and the sentence says whose: an address, or the
  publication by name (vLLM's announcement or blog, the workshop's slides, the seed run or script the course grew
  from, a paper).  A "published" figure must say whose: "one published measurement" names nobody.
- Otherwise it is the course's own measurement, and passes when its paragraph names a committed
  ``benchmarks/results/<name>`` that exists (a ``*`` pattern that matches one counts), or when the notebook's code
  reads one by name (``load_result("<name>")``, ``load_results()`` for all, or the path in a string), so the
  figures it prints come from there.

Review 3 found the figures this catches: "7.5 ms (measured)" in lessons 13 and 18 (from a table commit b510b9c
removed), lesson 06's A100/A10 tokens/s.  The old sentences are kept below: the rule must fail them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
NOTEBOOKS = sorted([*(ROOT / "notebooks").glob("*.ipynb"), *(ROOT / "solutions").glob("*.ipynb")])

UNIT = r"(?:\s?(?:ms|µs|s|tokens/s|tok/s|requests/s|GB/s|TB/s|TFLOP/s|GiB|GB|MiB|MB|%)|x)"  # 1.40x, not "2 x H200"
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?" + UNIT + r"(?![\w/])")
CODE_SPAN = re.compile(r"`[^`]*`")  # a column's name (`batch 1 tok/s`) or a log line is not a figure the prose gives
CLAIM = re.compile(r"\bmeasured\b|\bmeasurements?\b", re.I)
DENIED = re.compile(r"\bnot (?:a |yet )?measure(?:d|ments?)\b|\bno run has measured\b", re.I)
WHOSE = re.compile(r"https?://|vLLM's (?:[\w.]+ )*announcement|\bblog\b|\bworkshop's slides\b|\bthe workshop\b"
                   r"|\bseed (?:run|script|blog)\b|\bpaper\b", re.I)
RESULT_PATH = re.compile(r"benchmarks/results/([\w.*-]*[\w*][\w.*-]*)")
LOADED = re.compile(r"load_result\(\s*[\"']([\w.-]+)[\"']")
PUBLISHED = re.compile(r"\bpublished\b|\bpublication\b", re.I)
LOADS_ALL = re.compile(r"\bload_results\(")  # llmlab.rehearse.load_results(): every committed rehearsal


def committed(text: str) -> list[str]:
    """The committed results a text names: ``benchmarks/results/<name>`` paths that exist, and load_result names."""
    found = [m.group(1) for m in RESULT_PATH.finditer(text) if any(RESULTS.glob(m.group(1)))]
    return found + [m.group(1) for m in LOADED.finditer(text) if (RESULTS / m.group(1)).exists()]


def paragraphs(markdown: str) -> list[str]:
    return [item for block in re.split(r"\n\s*\n", markdown)
            for item in re.split(r"\n(?=\s*(?:[-*]|\d+\.)\s)", block)]


def sentences(paragraph: str) -> list[str]:
    return re.split(r"(?<=[.!?])\s+(?=[A-Z(*`-])", re.sub(r"\s+", " ", paragraph))


def unsourced(nb: dict) -> list[tuple[int, str]]:
    """(cell, sentence) for each sentence of ``nb``'s markdown that calls a figure measured and names no source."""
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    read_by_code = bool(committed(code) or LOADS_ALL.search(code))
    found = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        for paragraph in paragraphs("".join(cell["source"])):
            named = bool(committed(paragraph))
            for s in sentences(paragraph):
                if CLAIM.search(s) and FIGURE.search(CODE_SPAN.sub(" ", s)) and not DENIED.search(s):
                    ours = not PUBLISHED.search(s) and (named or read_by_code)
                    if not (ours or WHOSE.search(s)):
                        found.append((i, s))
    return found


def markdown(*cells: str, code: str = "") -> dict:
    nb = {"cells": [{"cell_type": "markdown", "source": c, "metadata": {}} for c in cells]}
    if code:
        nb["cells"].append({"cell_type": "code", "source": code, "metadata": {}, "outputs": []})
    return nb


# The sentences review 3 found, as they stood (git show b151ca6^:notebooks/18_..., 6353456^:notebooks/13_...).
OLD_18 = ("On one engine the two share the steps. Lesson 13 measured what that does on a GPU: a step of 64 running "
          "answers took\n7.5 ms; an 8,192-token prompt arriving beside them stretches one step by about 265 ms.")
OLD_13 = ("For Llama 3.1 8B on one H100 (the committed rehearsal in\n`benchmarks/results/h100-llama3.1-8b-tp1/`):\n\n"
          "- **KV memory.** A room of 30 holds 605 blocks, 1.2 GiB.\n"
          "- **Chunked prefill.** A decode step of 64 requests took 7.5 ms (measured). An 8,192-token prompt adds "
          "about 265 ms.")
OLD_06 = ("More GPUs do not always mean more throughput either: one published measurement of Llama 2 7B (59 prompts,\n"
          "offline batch) on 1, 2 and 4 A100s gave 843, 699 and 651 tokens/s.")


@pytest.mark.parametrize("text", [OLD_18, OLD_13, OLD_06], ids=["18 c0", "13 c18", "06 c36"])
def test_the_figures_review_3_found_have_no_source(text):
    assert unsourced(markdown(text)), text


def test_a_published_figure_says_whose_even_in_a_lesson_that_reads_committed_results():
    """Lesson 06 reads the H100 rehearsal in its code; that does not make someone else's A100 figures its own."""
    assert unsourced(markdown(OLD_06, code='rehearse.load_result("h100-llama3.1-8b-tp1")'))


def test_a_path_elsewhere_in_the_cell_does_not_cite_another_paragraphs_figure():
    """Lesson 13's cell named the rehearsal for its KV pool; its "7.5 ms (measured)" item named nothing."""
    assert [s for _, s in unsourced(markdown(OLD_13))] == ["- **Chunked prefill.** A decode step of 64 requests "
                                                           "took 7.5 ms (measured)."]


def test_a_named_file_a_loaded_result_or_a_named_publication_is_a_source():
    assert not unsourced(markdown("A step of 64 took 7.73 ms (measured: the committed H100 sweep, "
                                  "`benchmarks/results/h100-llama3.1-8b-tp1/rehearsal.json`)."))
    assert not unsourced(markdown("Measured on four H200s (`benchmarks/results/h200x4-*`): 81.0 tokens/s."))
    assert not unsourced(markdown("The H100 measured 3.01 TB/s.", code='rehearse.load_result("h100-llama3.1-8b-tp1")'))
    assert not unsourced(markdown("vLLM's Llama 3.1 announcement measured 2.82 requests/s on 8 H100s."))
    assert not unsourced(markdown("A prefill takes about 265 ms, an estimate, not a measurement."))
    assert unsourced(markdown("A step took 7.5 ms (measured, `benchmarks/results/no-such-run/`)."))
    assert unsourced(markdown("The H100 measured 3.01 TB/s.", code='rehearse.load_result("no-such-run")'))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_figure_a_lesson_calls_measured_names_its_source(path):
    found = unsourced(json.loads(path.read_text()))
    assert not found, "\n".join(f"{path.relative_to(ROOT)} cell {i}: {s}  -- name the committed file under "
                                "benchmarks/results/ (or the publication) it comes from" for i, s in found)
