"""The guides as tests (issue 47): every ``llmlab`` command an instructor or a learner is told to type in the
workshop guide, the handout and the READMEs parses with the CLI of today, and every repository path they name
exists.  Why: the guide drifted from the code in nineteen places (instructor-review-3's table), each found by
reading; a flag renamed or a file moved now fails CI instead of a workshop."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from llmlab import cluster
from llmlab.ops.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
GUIDES = ["docs/workshop.md", "docs/handout.md", "README.md", "slurm/README.md", "slurm/ood/llmlab/README.md",
          "docs/security.md"]
# The guides' placeholders, as a reader fills them in
PLACEHOLDERS = {"JOB": "123", "OLD_JOB": "122", "ID": "123", "USER": "alice", "ACCOUNT": "acct",
                "GPU_PARTITION": "gpu", "CPU_PARTITION": "cpu", "GROUP": "llmlab-ws", "DIR": "/tmp/d",
                "MODEL": "llama3.1-8b", "MODEL_A": "llama3.1-8b", "MODEL_B": "llama3.1-70b", "REPO": "org/model",
                "NAME": "llama3.1-8b", "FILE": "/tmp/f", "TRACES": "/tmp/t", "S": "2", "N": "2", "K": "30"}
REPO_PATH = re.compile(r"(?<![\w/.$~-])((?:benchmarks|slurm|tests|llmlab|docs|notebooks|solutions|exercises)/"
                       r"[\w.*/-]*[\w*/])")


def commands(text: str) -> list[tuple[int, str, bool]]:
    """(line, command, whole) of each ``llmlab ...``: in a fenced block a whole command to type (a ``\\`` continues
    it), in a code span a mention that may leave arguments out (``llmlab revoke``, ``--share``)."""
    found, lines, fenced, i = [], text.splitlines(), False, 0
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("```"):
            fenced = not fenced
        elif fenced and re.match(r"\s*(\$ )?llmlab ", line):
            start, cmd = i + 1, line.strip().removeprefix("$ ")
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1] + " " + lines[i].strip()
            found.append((start, cmd.split("  #")[0].split(" #")[0], True))
        elif not fenced:
            found += [(i + 1, m, False) for m in re.findall(r"`(llmlab [^`]+)`", line)]
        i += 1
    return found


def subparser(words: list[str]):
    """The parser of the subcommand ``words`` name (``weights fetch ...``) and the words after it; a name that is
    no subcommand raises KeyError."""
    parser = build_parser()
    while words and parser._subparsers is not None and not words[0].startswith("-"):
        parser = parser._subparsers._group_actions[0].choices[words[0]]
        words = words[1:]
    return parser, words


def parsable(cmd: str) -> str | None:
    """The command with its placeholders filled in, or None for one that is not meant to run as written (a list
    of alternatives, an ellipsis, a shell construct)."""
    if any(mark in cmd for mark in ("\\|", "|", "...", "…", "<", "$(", "&&")):
        return None
    cmd = re.sub(r"\[([^]]*)\]", r"\1", cmd)  # [--undo]: the optional part given
    return " ".join(PLACEHOLDERS.get(word, word) for word in cmd.split())


CASES = [(guide, line, cmd, whole) for guide in GUIDES for line, cmd, whole in commands((ROOT / guide).read_text())]


def test_the_guides_name_commands_at_all():
    """The reader above finds the guide's commands: if it stopped, the test below would check nothing."""
    assert len([c for c in CASES if c[0] == "docs/workshop.md" and c[3]]) >= 5
    assert any("launch llama3.1-70b" in c[2] for c in CASES)


@pytest.mark.parametrize("guide, line, cmd, whole", CASES, ids=[f"{g}:{n}" for g, n, _, _ in CASES])
def test_every_llmlab_command_in_the_guides_parses(guide, line, cmd, whole, capsys):
    """A command to type parses as it stands; a mention names a subcommand and options that exist."""
    filled = parsable(cmd)
    if filled is None:
        return
    words = shlex.split(filled)[1:]
    if whole:
        try:
            args = build_parser().parse_args(words)
        except SystemExit:
            pytest.fail(f"{guide}:{line}: `{cmd}` does not parse: {capsys.readouterr().err.strip()}")
        for model in getattr(args, "model", None) or [] if words[0] == "launch" else []:
            cluster.settings(model)  # a model the launcher knows (JobError names the fix otherwise)
        return
    try:
        parser, rest = subparser(words)
    except KeyError as e:
        pytest.fail(f"{guide}:{line}: `{cmd}` names {e}, which is no llmlab subcommand")
    unknown = [w for w in rest if w.startswith("--") and w.split("=")[0] not in parser._option_string_actions]
    assert not unknown, f"{guide}:{line}: `{cmd}`: {parser.prog} has no option {', '.join(unknown)}"


def test_every_repository_path_the_guides_name_exists():
    missing = []
    for guide in GUIDES:
        for n, line in enumerate((ROOT / guide).read_text().splitlines(), 1):
            for path in REPO_PATH.findall(line):
                if "*" in path and any(ROOT.glob(path)) or (ROOT / path).exists() or re.search(r"/[A-Z_]+\b", path):
                    continue  # there, or a placeholder (slurm/NAME.sh)
                missing.append(f"{guide}:{n}: {path}")
    assert not missing, "\n".join(missing)
