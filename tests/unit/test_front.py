"""llmlab.ops.front: several models' jobs behind one endpoint (issue 41) -- the set checked, the front's job script,
and the wait for the models' connection files.  The router itself is tested in tests/unit/test_replicas.py and,
with two real engines and the front's process, in tests/engine/test_replicas.py."""

from __future__ import annotations

import json
import sys

import pytest

from llmlab import cluster
from llmlab.ops import cli, front, jobs
from llmlab.serve.info import ServerError, ServerInfo, ended_marker, llmlab_home


@pytest.fixture(autouse=True)
def own_home(tmp_path, monkeypatch):
    """The models' and the front's connection files go to a home of the test's own, never the session's."""
    monkeypatch.setenv("LLMLAB_HOME", str(tmp_path / "home"))


def publish(job_id: str, model: str, status: str, port: int = 8000, **extra) -> None:
    ServerInfo(kind="slurm", host=f"node-{job_id}", port=port, model=model, status=status, job_id=job_id,
               api_key_file=str(llmlab_home() / "keys" / f"job-{job_id}.key"), extra=extra).write(
        cluster.connection_file_of(job_id))


def test_a_set_is_two_models_or_more_each_once():
    eight, seventy = cluster.prepare("llama3.1-8b"), cluster.prepare("llama3.1-70b")
    front.check_set([eight, seventy])
    with pytest.raises(cluster.JobError, match="llama3.1-8b given twice"):
        front.check_set([eight, seventy, eight])
    with pytest.raises(cluster.JobError, match="a set is two models or more"):
        front.check_set([eight])


def test_the_front_job_is_one_cpu_task_that_names_its_models_jobs(tmp_path):
    short = cluster.prepare("llama3.1-8b", time_limit="02:00:00")
    long = cluster.prepare("llama3.1-70b", time_limit="1-00:00:00")
    assert front.front_options(None, None, None, [short, long])["time"] == "1-00:00:00"  # not before the models end
    assert front.front_options(None, None, "03:00:00", [short, long])["time"] == "03:00:00"
    options = front.front_options("course", "gpu", None)
    assert options["cpus-per-task"] == "2" and "gpus-per-node" not in options and options["partition"] == "gpu"
    script = front.front_script(["101", "102"], ["llama3.1-8b", "llama3.1-70b"], options,
                                share=("ws", tmp_path / "ws"), command="llama3.1-8b llama3.1-70b --share ws")
    assert "# Rendered by `llmlab launch llama3.1-8b llama3.1-70b --share ws`: one endpoint in front of job 101 " \
           "(llama3.1-8b), job 102 (llama3.1-70b)" in script
    assert "#SBATCH --job-name=llmlab-front" in script and f"export LLMLAB_SHARE_DIR={tmp_path / 'ws'}" in script
    assert script.rstrip().endswith('-m llmlab.ops.front --job 101 --job 102')
    with pytest.raises(cluster.JobError, match="a newline"):
        front.front_script(["101"], ["bad\nname"], options)


def test_the_front_waits_for_every_model_and_says_which_it_awaits(capsys):
    publish("101", "llama3.1-8b", "ready", port=8101)
    publish("102", "llama3.1-70b", "loading", phase="loading weights 3/30")
    ready, waiting = front.members_ready(["101", "102"])
    assert [m.model for m in ready] == ["llama3.1-8b"] and waiting == ["job 102 (llama3.1-70b: loading weights 3/30)"]
    with pytest.raises(ServerError, match="not every model answered within 0 s: waiting for job 102"):
        front.wait_for_members(["101", "102"], timeout=0, poll=0)
    assert "waiting for job 102 (llama3.1-70b: loading weights 3/30)" in capsys.readouterr().out
    publish("102", "llama3.1-70b", "ready", port=8102)
    members = front.wait_for_members(["101", "102"], timeout=0, poll=0)
    upstreams, key_files = front.router_upstreams(members)
    assert upstreams == {"llama3.1-8b": ["http://node-101:8101"], "llama3.1-70b": ["http://node-102:8102"]}
    assert key_files["llama3.1-70b"].name == "job-102.key"


def test_a_model_whose_job_ended_ends_the_wait_with_a_sentence():
    publish("101", "llama3.1-8b", "ready")
    ended_marker("103").write_text("llama3.1-70b\n")
    with pytest.raises(ServerError, match=r"job 103's connection file .* is gone: it ended before the front could "
                                          r"route to it; `llmlab status 103` says why"):
        front.members_ready(["101", "103"])


def test_launch_of_several_models_prints_each_plan_and_the_front(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["llmlab", "launch", "llama3.1-8b", "llama3.1-70b", "--dry-run"])
    assert cli.main(["launch", "llama3.1-8b", "llama3.1-70b", "--dry-run", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [p["gpus"] for p in shown["plans"]] == [1, 4] and "--job '<job of llama3.1-8b>'" in shown["front"]
    assert cli.main(["launch", "llama3.1-8b", "llama3.1-70b", "--tp", "2", "--dry-run"]) == 2
    assert "apply to one model" in capsys.readouterr().err


def test_a_front_whose_model_is_gone_says_so_and_leaves_nothing_published(capsys):
    publish("401", "llama3.1-8b", "ready")  # ids of its own: the session shares one home
    assert front.serve_front(["401", "402"], "300", timeout=0, poll=0) == 1
    assert "FAILED: job 402's connection file" in capsys.readouterr().out
    assert not cluster.connection_file_of("300").exists() and ended_marker("300").exists()
    assert not (llmlab_home() / "keys" / "job-300.key").exists()


def test_status_of_a_front_names_its_models_and_their_jobs(monkeypatch):
    publish("501", "llama3.1-8b", "ready", members={"llama3.1-8b": "502", "llama3.1-70b": "503"})
    st = jobs.JobStatus("501", "STARTING", "")
    monkeypatch.setattr(cluster, "is_alive", lambda info, timeout: True)
    assert jobs._ready_status(st, cluster.connection_file_of("501")).detail.startswith(
        "llama3.1-8b, llama3.1-70b at http://node-501:8000/v1")
    monkeypatch.setattr(cluster, "is_alive", lambda info, timeout: False)
    down = jobs._ready_status(st, cluster.connection_file_of("501"))
    assert down.state == "FAILED" and "`llmlab status 503` (llama3.1-70b) says which" in down.detail


def test_the_front_watches_its_models_says_which_ended_and_ends_when_none_is_left(capsys):
    """security-review-3 F1: the front no longer reads its models once and forgets them.  A model whose job ended
    is said once (job output and the front's connection file, ``ended``); its requests get the router's 503 (the
    port no longer proves it holds the job's key: tests/engine/test_proxy.py); with no model left the front ends."""
    import subprocess
    import threading
    from types import SimpleNamespace

    publish("501", "llama3.1-8b", "ready")
    publish("502", "llama3.1-70b", "ready")
    members = [ServerInfo.read(cluster.connection_file_of(j)) for j in ("501", "502")]
    router = subprocess.Popen(["sleep", "60"])
    published = []
    ended_marker("501").write_text("ended\n")  # the 8B's job ended (its launcher's clean-up leaves this)
    threading.Timer(0.5, cluster.connection_file_of("502").unlink).start()  # then the 70B's job is gone
    try:
        code = front.watch_members(SimpleNamespace(router=router), members, published.append, poll=0.05)
    finally:
        router.kill()
    assert code == 0 and router.wait() != 0  # the front stopped its router
    assert published == [["llama3.1-8b"], ["llama3.1-8b", "llama3.1-70b"]]
    out = capsys.readouterr().out
    assert out.count("the job of llama3.1-8b ended: requests for it now get 503") == 1
    assert "no model is left, so the front ends too" in out


def test_the_room_file_is_a_ready_jobs_and_an_older_job_does_not_take_it_back(tmp_path, monkeypatch):
    """Issue 47, item 2: the room's server.json is written at a job's first READY, never while it loads; once a newer
    job took the room over, the older job's later rewrites (a front saying a model ended) leave it alone.  Before, a
    loading job overwrote a working server's file, and any rewrite took the room back."""
    from llmlab.ops.launcher import publish_connection
    from llmlab.serve import share

    monkeypatch.setenv("LLMLAB_SHARE_DIR", str(tmp_path))

    def job(job_id: str, status: str) -> None:
        publish_connection(cluster.connection_file_of(job_id), kind="slurm", host=f"node-{job_id}", port=8000,
                           model="llama3.1-8b", api_key_file="/nonexistent/key", job_id=job_id, status=status)

    job("601", "loading")
    assert share.holder(tmp_path) is None and not (tmp_path / "server.json").exists()
    job("601", "ready")
    job("602", "loading")
    assert share.holder(tmp_path) == "601"
    job("602", "ready")
    job("601", "ready")  # the old job's rewrite, after the hand-over
    assert share.holder(tmp_path) == "602"
    assert not share.unpublish(tmp_path, "601") and share.unpublish(tmp_path, "602")
    assert not (tmp_path / "server.json").exists()

