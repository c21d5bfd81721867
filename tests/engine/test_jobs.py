"""llmlab.ops.jobs against the session's embedded server: a job's files say READY exactly when its server answers.

The pure tests of llmlab.ops.jobs are in tests/unit/test_jobs.py, the jobs under the SLURM test bed in
tests/cluster/test_jobs.py.
"""

import pytest
from slurm_helpers import RETRIED, job_files

from llmlab import cluster
from llmlab.ops import jobs
from llmlab.serve.info import write_connection_file
from llmlab.serve.proc import free_port


@pytest.mark.server
def test_a_server_that_answers_is_ready_whatever_its_logs_said(embedded, tmp_path, monkeypatch):
    """vLLM logs handled exceptions with tracebacks, and Ray may have needed a second attempt: a server that
    answers is READY; the same files with nobody answering are FAILED, saying so."""
    job_id = job_files(tmp_path, monkeypatch, RETRIED,
                       "(APIServer pid=9) ERROR 11-23 10:01:02 [serving.py:1] Traceback (most recent call last): x\n")
    conn = cluster.connection_file_of(job_id)
    write_connection_file(conn, kind="slurm", host=embedded.host, port=embedded.port, model=embedded.model,
                          api_key_file=embedded.api_key_file, job_id=job_id)
    assert jobs.status(job_id).state == "READY"
    write_connection_file(conn, kind="slurm", host="127.0.0.1", port=free_port("127.0.0.1"),
                          model="m", api_key_file=embedded.api_key_file, job_id=job_id)
    st = jobs.status(job_id)
    assert st.state == "FAILED" and "does not answer /health now" in st.detail, str(st)
