"""Fixtures shared by several test modules (the course's pytest plugin, ``llmlab.ops.testing``, holds the rest)."""

import subprocess

import pytest


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 16 KiB file system (tmpfs) that fills up part-way through a run: ENOSPC as the kernel gives it,
    short writes included.  Mounting needs root, as CI has."""
    where = tmp_path / "tiny"
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k,mode=0700", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a 16 KiB tmpfs to fill up (needs root): {res.stderr.strip()}")
    try:
        yield where
    finally:  # lazily if a file is still open there (a leak the test then reports), so no mount stays behind
        if subprocess.run(["umount", str(where)]).returncode:
            subprocess.run(["umount", "-l", str(where)], check=True)
