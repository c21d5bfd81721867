"""The workshop guide's own commands, run (issue 47): each fenced block of docs/workshop.md marked
``<!-- guide:run -->`` is run in the guide's order under the SLURM test bed, as an instructor would type it, then
the job it launched is stopped.  The few words a test bed cannot have are swapped by the table below: the 70B for
the course's CPU job on one node (no Ray: a second engine's start beside the other lane's is load enough), the
site's partition, group and folders for the test bed's.  Every flag and the order of the steps are the guide's, so
a flag that drifts, a step that no longer works or a block that stops making sense fails CI.
tests/unit/test_guide.py parses every other command the guides name."""

from __future__ import annotations

import grp
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from slurm_helpers import needs_slurm

pytestmark = [needs_slurm]
ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- guide:run"


def marked_blocks(text: str) -> list[list[str]]:
    """The commands of each marked fenced block, in order (a trailing ``\\`` continues a line)."""
    blocks, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if MARK in line and lines[i + 1].strip().startswith("```"):
            cmds, j = [], i + 2
            while not lines[j].strip().startswith("```"):
                cmds.append(lines[j].strip())
                j += 1
            blocks.append(re.sub(r"\\\s*\n\s*", " ", "\n".join(cmds)).splitlines())
    return blocks


def for_the_test_bed(cmd: str, share_dir: Path) -> str:
    """The guide's command with a site's words made the test bed's (see the module docstring; the share group is
    the tester's own)."""
    swaps = [(r"\bllama3\.1-70b\b", "llmlab-tiny-cpu --nodes 1"), (r"--max-model-len \d+ ?", ""),
             (r"--account \S+ ?", ""),
             (r"\bGPU_PARTITION\b", "debug"), (r"--share \S+", f"--share {grp.getgrgid(os.getgid()).gr_name}"),
             (r"/scratch/course/ws", str(share_dir))]
    for pattern, new in swaps:
        cmd = re.sub(pattern, new, cmd)
    return cmd.split("  #")[0].strip()


def test_the_guide_marks_its_dry_run_and_its_launch():
    blocks = marked_blocks((ROOT / "docs" / "workshop.md").read_text())
    assert [b[0].split()[:2] for b in blocks] == [["llmlab", "launch"], ["llmlab", "launch"]]
    assert "--dry-run" in blocks[0][0] and blocks[1][1].startswith("llmlab status --wait")


def test_the_guides_dry_run_and_launch_run_as_written(slurm_env):
    share_dir = Path(tempfile.mkdtemp(prefix="llmlab-guide-")) / "ws"  # not under pytest's 0700 folder
    env = {**os.environ, **slurm_env}
    launched = []
    try:
        for block in marked_blocks((ROOT / "docs" / "workshop.md").read_text()):
            for line in block:
                cmd = for_the_test_bed(line, share_dir)
                argv = [sys.executable, "-m", "llmlab", *cmd.split()[1:]]
                done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
                assert done.returncode == 0, f"`{cmd}` (the guide's `{line}`):\n{done.stdout[-1500:]}{done.stderr}"
                launched += re.findall(r"submitted job (\d+)", done.stdout)
        assert launched and (share_dir / "server.json").is_file()  # the room's file, written at READY
    finally:
        for job in launched:
            subprocess.run([sys.executable, "-m", "llmlab", "stop", job], env=env, capture_output=True, timeout=300)
    assert not (share_dir / "server.json").exists()  # the job's clean-up removed its own room file
