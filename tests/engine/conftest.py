"""The engine tier: tests of the real vLLM engine -- the session's embedded server (the ``embedded`` and ``api_key``
fixtures of ``llmlab.ops.testing``, started once), engines a test starts for itself (a killed server, a second
budget, the offline engine), JupyterLab in a browser, and real file systems that fill up (root)."""

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
