"""``llmlab weights``: plan, fetch, verify and stage, on real safetensors trees made from the shipped tiny model.

The trees are real: the tiny model's own tensors, written by safetensors' ``save_file`` into three shards with a
``model.safetensors.index.json`` as transformers writes one, then damaged the ways a workshop meets them (a shard cut
short, a shard missing, a header overwritten, a file the group cannot read).  The download is tested as far as no
hub allows: no test here reaches huggingface.co.  The hub's answers are played by a local HTTP server (a gated
repository's 401 with the hub's ``X-Error-Code: GatedRepo``) or by a closed local port (no network), so
huggingface_hub's own ``snapshot_download`` runs unpatched and raises its own errors; the download of real files
is not tested here.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import socket
import stat
import tempfile
import threading
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from llmlab import memory
from llmlab.ops import cli, weights

TINY = memory.MODELS_DIR / memory.TINY_NAME
TINY_PARAMS = 3_672_320


def copy_tiny(dest: Path) -> Path:
    shutil.copytree(TINY, dest)
    weights.make_group_readable(dest)
    return dest


# what a stage leaves in its folder: the copy (its private manifest inside it)
STAGED = ["llmlab-tiny"]


@pytest.fixture
def tree(tmp_path) -> Path:
    """The tiny model as one model.safetensors (as shipped), group-readable."""
    return copy_tiny(tmp_path / "shared" / "llmlab-tiny")


@pytest.fixture
def sharded(tmp_path) -> Path:
    """The tiny model in three shards with an index, written by safetensors' own save_file."""
    root = copy_tiny(tmp_path / "shared" / "llmlab-tiny")
    tensors = load_file(root / "model.safetensors")
    (root / "model.safetensors").unlink()
    names = sorted(tensors)
    parts = [names[i::3] for i in range(3)]
    weight_map, total = {}, 0
    for i, part in enumerate(parts, 1):
        shard = f"model-{i:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in part}, root / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
        total += sum(tensors[n].nbytes for n in part)
    (root / weights.INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    weights.make_group_readable(root)
    return root


def shard(root: Path, i: int) -> Path:
    return root / f"model-{i:05d}-of-00003.safetensors"


def test_a_complete_sharded_tree_verifies_and_its_headers_count_memorys_parameters(sharded):
    v = weights.verify(sharded)
    assert v.ok, v.problems
    assert v.shards == 3
    assert v.params == v.expected_params == memory.param_count(memory.TINY_NAME) == TINY_PARAMS
    assert v.dtypes == ["float32"]


def test_the_shipped_single_file_tree_verifies(tree):
    assert weights.verify(tree).ok


def test_a_truncated_shard_is_named_with_its_sizes_and_the_fix(sharded, capsys):
    path = shard(sharded, 2)
    size = path.stat().st_size
    os.truncate(path, size - 1000)
    v = weights.verify(sharded)
    assert len(v.problems) == 1, v.problems
    assert f"{path} is truncated: {size - 1000:,} bytes where its header's data offsets need {size:,}" in v.problems[0]
    assert "fetch it again" in v.problems[0]
    assert cli.main(["weights", "verify", str(sharded)]) == 1
    assert "PROBLEM: " in capsys.readouterr().out


def test_a_missing_shard_is_named_and_its_tensors_counted_missing(sharded):
    shard(sharded, 3).unlink()
    v = weights.verify(sharded)
    assert not v.ok
    assert any(p.startswith(f"{shard(sharded, 3)} is missing (the index names it)") for p in v.problems)
    assert any("tensor(s) of the config are in no shard" in p for p in v.problems)


def test_a_corrupted_header_is_named(sharded):
    path = shard(sharded, 1)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage\xff" * 4)
    v = weights.verify(sharded)
    assert any(p.startswith(f"{path}'s safetensors header is corrupt: its header is not valid JSON")
               for p in v.problems), v.problems


def test_a_header_length_overwritten_is_named(sharded):
    path = shard(sharded, 1)
    with open(path, "r+b") as f:
        f.write(b"\xff" * 8)
    v = weights.verify(sharded)
    assert any("more than safetensors allows" in p for p in v.problems), v.problems


def test_a_shard_the_group_cannot_read_is_named_with_chmod(sharded):
    path = shard(sharded, 2)
    path.chmod(0o600)
    v = weights.verify(sharded)
    assert len(v.problems) == 1, v.problems
    assert v.problems[0].startswith(f"{path} is not readable by the group (-rw-------)")
    assert f"chmod -R g+rX {sharded}" in v.problems[0]
    assert weights.verify(sharded, group=False).ok  # a node-local copy is the job's user's only


def test_a_stored_lm_head_of_tied_embeddings_is_counted_once(tree):
    tensors = load_file(tree / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, tree / "model.safetensors", metadata={"format": "pt"})
    weights.make_group_readable(tree)
    v = weights.verify(tree)
    assert v.ok, v.problems
    assert v.params == TINY_PARAMS
    assert any("counted once" in n for n in v.notes)


def test_weights_of_another_dtype_or_model_than_the_config_are_problems(tree):
    config = json.loads((tree / "config.json").read_text())
    (tree / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    assert any("not in the config's dtype bfloat16" in p for p in weights.verify(tree).problems)
    (tree / "config.json").write_text(json.dumps({**config, "intermediate_size": 512}))
    problems = weights.verify(tree).problems
    assert any("mlp.down_proj.weight has shape [256, 640], the config gives [256, 512]" in p for p in problems)


def test_plan_of_a_sharded_tree_lists_its_files_and_the_disk_there(sharded, tmp_path, capsys):
    p = weights.plan(sharded, to=tmp_path / "local" / "new")
    assert p["shards"] == 3 and p["exact"] and p["params"] == TINY_PARAMS and p["dtype"] == "float32"
    assert p["index_total_size"] == TINY_PARAMS * 4
    assert p["bytes"] == sum(f.stat().st_size for f in sharded.iterdir() if f.is_file())
    assert p["free_on"] == str(tmp_path) and p["fits"] == (p["free_bytes"] >= p["bytes"])
    assert cli.main(["weights", "plan", str(sharded), "--to", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "model-00002-of-00003.safetensors" in out and "fits" in out


def test_plan_of_a_known_name_estimates_from_memory_and_says_when_it_does_not_fit(tmp_path, capsys):
    p = weights.plan("meta-llama/Llama-3.1-70B-Instruct", to=tmp_path)
    assert p["bytes"] == memory.weight_bytes("llama3.1-70b") == 141_107_412_992  # docs/workshop.md's figure
    assert p["shards"] == 29 and not p["exact"] and p["dtype"] == "bfloat16"
    assert p["repo"] == "meta-llama/Llama-3.1-70B-Instruct"
    fits = p["fits"]
    assert cli.main(["weights", "plan", "llama3.1-70b", "--to", str(tmp_path)]) == (0 if fits else 1)
    assert ("fits" if fits else "does NOT fit") in capsys.readouterr().out
    with pytest.raises(weights.WeightsError, match="neither a model folder nor a model llmlab knows"):
        weights.plan("nobody/nothing")


def test_make_group_readable_sets_2750_and_0640_on_a_real_tree(tree):
    (tree / "sub").mkdir(mode=0o700)
    (tree / "sub" / "x.json").write_text("{}")
    (tree / "sub" / "x.json").chmod(0o600)
    (tree / "config.json").chmod(0o600)
    assert not weights.verify(tree).ok
    group = __import__("grp").getgrgid(os.getgid()).gr_name
    said = weights.make_group_readable(tree, group)
    assert said == f"2 folder(s) 2750 and {len([p for p in tree.rglob('*') if p.is_file()])} file(s) 640, group {group}"
    assert {oct(p.stat().st_mode & 0o7777) for p in [tree, tree / "sub"]} == {"0o2750"}
    assert {oct(p.stat().st_mode & 0o7777) for p in tree.rglob("*") if p.is_file()} == {"0o640"}
    assert weights.verify(tree).ok
    with pytest.raises(weights.WeightsError, match="no UNIX group 'no-such-group-xyz'"):
        weights.make_group_readable(tree, "no-such-group-xyz")


def test_verify_notes_a_folder_above_the_tree_that_the_group_cannot_pass(tmp_path):
    """The tree's own modes were all verify read: a 0700 folder above it (a home, a private scratch folder) stops
    a co-instructor's or a learner's job at load time all the same."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    tree = copy_tiny(private / "llmlab-tiny")
    v = weights.verify(tree)
    assert v.ok  # the instructor's own jobs read it: a note with the fix, not a problem
    note = next(n for n in v.notes if n.startswith("the group "))
    assert f"{private} (drwx------)" in note and f"`chmod o+x {private}`" in note
    private.chmod(0o711)
    assert str(private) not in " ".join(weights.verify(tree).notes)
    assert not any(n.startswith("the group ") for n in weights.verify(tree, group=False).notes)


GATED_ANSWER = (401, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model someorg/gated is restricted."})
EXPIRED = (401, {"X-Error-Message": "Invalid credentials in Authorization header"})  # the hub's, for a stale token
ALLOWED = (200, {})  # auth-check's answer to an account that may read the repository


@contextlib.contextmanager
def local_hub(*answers):
    """A local stand-in of the hub (no hub may be reached from a test): the n-th request gets ``answers[n]`` (the
    last from then on) as (status, headers) with an empty body; yields its endpoint and the paths requested."""
    seen: list[str] = []

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, headers = answers[min(len(seen), len(answers) - 1)]
            seen.append(self.path)
            self.send_response(status)
            for key, value in {**headers, "Content-Length": "0"}.items():
                self.send_header(key, value)
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", seen
    finally:
        server.shutdown()


def test_fetch_of_a_gated_model_says_accept_the_licence_and_log_in(tmp_path, capsys):
    """huggingface_hub's own client against a local stand-in of the hub (no hub may be reached from a test): its 401
    with ``X-Error-Code: GatedRepo`` is what huggingface_hub turns into GatedRepoError.  The access check is the
    first request, and nothing is asked for after it."""
    with local_hub(GATED_ANSWER) as (endpoint, seen), pytest.raises(weights.WeightsError) as e:
        weights.fetch("someorg/gated", tmp_path / "gated", token=False, endpoint=endpoint)
    assert str(e.value) == weights.GATED.format(repo="someorg/gated")
    assert "accept its licence" in str(e.value) and "hf auth login" in str(e.value) and "HF_TOKEN" in str(e.value)
    assert seen == ["/api/models/someorg/gated/auth-check"]


def _partial(to: Path) -> Path:
    """What an interrupted fetch leaves: some of the files, none of the shards."""
    to.mkdir(parents=True)
    shutil.copyfile(TINY / "config.json", to / "config.json")
    return to


@pytest.mark.parametrize("answer", [GATED_ANSWER, EXPIRED], ids=["licence not accepted", "token expired"])
def test_a_resumed_fetch_the_hub_refuses_says_the_gated_sentence(tmp_path, answer):
    """A resume into a folder that holds files: huggingface_hub's snapshot_download returned that folder with a
    logged warning when the hub refused the listing, and fetch went on to verify it (the instructor was sent back
    to fetch).  Now the access check refuses first."""
    to = _partial(tmp_path / "gated")
    with local_hub(answer) as (endpoint, _), pytest.raises(weights.WeightsError) as e:
        weights.fetch("someorg/gated", to, token=False, endpoint=endpoint)
    assert str(e.value) == weights.GATED.format(repo="someorg/gated")
    assert not (to / weights.RECORD).exists()


def test_a_token_expiring_after_the_access_check_is_no_silent_success(tmp_path):
    """The access check passes, then the hub refuses the listing (the token expired in between): snapshot_download
    returns the partial folder behind a warning; fetch catches the warning and says the gated sentence."""
    to = _partial(tmp_path / "gated")
    with local_hub(ALLOWED, EXPIRED) as (endpoint, seen), pytest.raises(weights.WeightsError) as e:
        weights.fetch("someorg/gated", to, token=False, endpoint=endpoint)
    assert str(e.value) == weights.GATED.format(repo="someorg/gated")
    assert seen[0].endswith("/auth-check") and seen[-1].endswith("/auth-check") and len(seen) > 2


def test_a_listing_the_hub_fails_after_the_access_check_is_said(tmp_path):
    """The access check passes, the listing gets a 500 (the hub down): no success, the hub's own words."""
    to = _partial(tmp_path / "m")
    with local_hub(ALLOWED, (500, {}), ALLOWED) as (endpoint, _), pytest.raises(weights.WeightsError) as e:
        weights.fetch("someorg/model", to, token=False, endpoint=endpoint)
    assert str(e.value).startswith("the hub did not list the files of someorg/model (")
    assert "run the same fetch again when the hub answers" in str(e.value)


def test_fetch_checks_the_group_before_the_hub(tmp_path):
    """A misspelt --group was found after the whole download (it was checked last); now before the hub is asked
    (here no hub answers: the group's sentence comes first)."""
    with pytest.raises(weights.WeightsError, match="there is no UNIX group 'no-such-group-xyz' here"):
        weights.fetch("someorg/model", tmp_path / "m", group="no-such-group-xyz", token=False,
                      endpoint=f"http://127.0.0.1:{closed_port()}")


@pytest.mark.skipif(os.geteuid() != 0, reason="running as another user needs root (CI runs as root)")
def test_a_co_instructor_resuming_anothers_fetch_is_told_whose_it_is(tmp_path):
    """A second instructor, in the tree's group but not its owner, resumes a fetch: the folders are 2750 (the
    learners are in the group), so the hub's client failed with a traceback writing its metadata; now one sentence
    before the hub is asked, naming the owner."""
    top = Path(tempfile.mkdtemp(prefix="llmlab-coinstructor-"))  # reachable by another user, unlike pytest's folder
    try:
        top.chmod(0o755)
        to = _partial(top / "m")
        (to / ".cache" / "huggingface").mkdir(parents=True)
        for p in (to, *to.rglob("*")):
            os.chown(p, 0, 65534)  # root's, of nobody's group
        weights.make_group_readable(to)
        said = as_nobody(lambda: weights.fetch("someorg/model", to, token=False,
                                               endpoint=f"http://127.0.0.1:{closed_port()}"))
    finally:
        shutil.rmtree(top)
    assert said.startswith(f"WeightsError: {to} belongs to user root and you cannot write in it (drwxr-s---)"), said
    assert "ask user root to run the same fetch, or fetch into a folder of your own" in said


MOUNTS = """sysfs /sys sysfs rw 0 0
/dev/sda1 / ext4 rw 0 0
10.0.0.1@tcp:/lustre /scratch lustre rw,flock 0 0
gpfs0 /gpfs/projects gpfs rw 0 0
server:/home /home nfs4 rw 0 0
"""


def test_the_quota_command_follows_the_file_system_of_the_folder(tmp_path):
    """Free bytes are the file system's; the command that shows the user's quota is the file system's own."""
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS)
    assert weights.quota_command("/scratch/me/models", mounts).startswith("`lfs quota -u $USER /scratch`")
    assert weights.quota_command("/gpfs/projects/ws", mounts) == "`mmlsquota`"
    assert weights.quota_command("/home/me", mounts) == weights.quota_command("/opt", mounts) == "`quota -s`"
    assert weights.quota_command("/scratch", tmp_path / "no-mount-table") == weights.ANY_QUOTA


def test_plan_and_fetch_say_the_quota_command_and_where_hf_home_caches(tmp_path, capsys):
    """plan and fetch said only the free bytes (a 100 GB quota on a 500 TB file system passed, then EDQUOT mid-
    download) and nothing of HF_HOME (the token and the Xet cache, in a small home by default)."""
    from huggingface_hub import constants

    here = weights.quota_command(tmp_path)
    assert weights.plan("llama3.1-70b", to=tmp_path)["quota_command"] == here
    cli.main(["weights", "plan", "llama3.1-70b", "--to", str(tmp_path)])
    assert f"the free bytes are the file system's; yours may be less: {here}" in capsys.readouterr().out
    said = []
    with pytest.raises(weights.WeightsError) as e:  # no space here, or else no hub: both after what is said
        weights.fetch("llama3.1-70b", tmp_path / "w70", token=False, endpoint=f"http://127.0.0.1:{closed_port()}",
                      say=said.append)
    assert said[0].startswith(f"the hub's client keeps your token and its Xet cache in HF_HOME={constants.HF_HOME}")
    assert f"your quota may be less: {here} shows it" in said[1]
    assert "cannot be reached" in str(e.value) or f"{here} shows it" in str(e.value)


def as_nobody(call) -> str:
    """``call()`` in a child process that runs as user and group nobody (65534): what it raised, or ''."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        said = ""
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            call()
        except BaseException as e:  # noqa: BLE001 -- reported to the parent
            said = f"{type(e).__name__}: {e}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read()
    os.waitpid(pid, 0)
    return said


@pytest.mark.skipif(os.geteuid() != 0, reason="running as another user needs root (CI runs as root)")
def test_fetch_by_a_user_outside_the_group_is_refused_before_the_hub(tmp_path):
    said = as_nobody(lambda: weights.fetch("someorg/model", tmp_path / "m", group="root", token=False,
                                           endpoint=f"http://127.0.0.1:{closed_port()}"))
    assert said.startswith("WeightsError: you are not in the UNIX group 'root' (`id -Gn` lists yours)"), said


def test_fetch_without_network_says_where_to_fetch_from(tmp_path):
    """No network: a closed local port as the hub's endpoint, so huggingface_hub meets a refused connection itself
    (no hub may be reached from a test)."""
    with pytest.raises(weights.WeightsError, match="the hub cannot be reached from here"):
        weights.fetch("someorg/model", tmp_path / "m", token=False, endpoint=f"http://127.0.0.1:{closed_port()}")


def closed_port() -> int:
    """A local port nothing listens on (bound, then closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_gated_error_raised_by_huggingface_hub_reads_as_one_sentence():
    from httpx2 import Request, Response
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError

    response = Response(403, request=Request("GET", "https://huggingface.co/api/models/meta-llama/x"))
    assert weights.explain_hub_error(GatedRepoError("gated", response=response), "meta-llama/x") == \
        weights.GATED.format(repo="meta-llama/x")
    assert weights.explain_hub_error(HfHubHTTPError("403", response=response), "m/x").startswith("m/x is gated")
    assert weights.explain_hub_error(ValueError("other"), "m/x") is None


def test_stage_copies_with_progress_and_time_then_skips_a_verified_copy(sharded, tmp_path, capsys):
    local = tmp_path / "local"
    first = weights.stage(sharded, local)
    dest = local / "llmlab-tiny"
    assert not first["skipped"] and first["dest"] == str(dest)
    assert first["bytes"] == sum(f.stat().st_size for f in sharded.iterdir() if f.is_file())
    assert first["seconds"] > 0 and first["mb_per_s"] > 0
    captured = capsys.readouterr()
    assert f"staged {sharded} -> {dest}: " in captured.out and " MB/s)" in captured.out
    assert "staging llmlab-tiny" in captured.err  # tqdm's bar
    assert weights.verify(dest).ok and weights.same_files(sharded, dest)
    assert sorted(p.name for p in local.iterdir()) == STAGED  # the temporary name is gone

    second = weights.stage(sharded, local)
    assert second["skipped"] and "already holds this stage's verified copy" in capsys.readouterr().out

    os.truncate(shard(dest, 1), 100)  # a broken local copy is replaced, not trusted
    third = weights.stage(sharded, local)
    assert not third["skipped"] and weights.verify(dest).ok
    assert sorted(p.name for p in local.iterdir()) == STAGED


def test_stage_refuses_a_source_that_does_not_verify(sharded, tmp_path):
    shard(sharded, 3).unlink()
    with pytest.raises(weights.WeightsError, match="does not verify, so it is not staged"):
        weights.stage(sharded, tmp_path / "local")
    assert cli.main(["weights", "stage", str(sharded), "--to", str(tmp_path / "local")]) == 2


def test_two_nodes_staging_into_one_shared_folder_keep_one_copy(sharded, tmp_path, monkeypatch):
    """A stage folder on a disk the nodes share (a misconfigured LLMLAB_STAGE_DIR, or the SLURM test bed's two
    nodes on one machine): the other node renames its verified copy into place between this node's check and its
    own rename.  This node keeps theirs (vLLM may be reading it) and drops its own copy; nothing fails."""
    local = tmp_path / "local"
    real = weights._staged_by_another
    calls = []

    def the_other_node_finishes_just_after_the_check(src, dest, tmp):
        calls.append(dest.exists())
        if len(calls) == 1:
            shutil.copytree(sharded, dest)  # its copy lands now, after this node looked, with its manifest
            weights._write_manifest(dest)
            return False
        return real(src, dest, tmp)

    monkeypatch.setattr(weights, "_staged_by_another", the_other_node_finishes_just_after_the_check)
    done = weights.stage(sharded, local, progress=False)
    assert calls == [False, True] and not done["skipped"]
    assert sorted(p.name for p in local.iterdir()) == STAGED and weights.verify(local / "llmlab-tiny").ok


def test_a_dummy_tree_is_real_safetensors_that_verifies(tmp_path):
    """The benchmark's dummy trees (an 8B-sized one for the GPU machine) are written without safetensors, chunk by
    chunk; safetensors' own reader opens them, and verify finds the config's tensors."""
    from safetensors import safe_open

    root = weights.dummy_tree(memory.TINY_NAME, tmp_path / "dummy", shard_bytes=6 * 10**6)
    weights.make_group_readable(root)
    v = weights.verify(root)
    assert v.ok and v.shards == 3 and v.params == TINY_PARAMS, v.problems
    count = 0
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(path, "np") as f:
            count += sum(f.get_tensor(k).size for k in f.keys())
    assert count == TINY_PARAMS


def test_stage_removes_what_a_killed_stage_left_and_keeps_a_live_ones(sharded, tmp_path):
    local = tmp_path / "local"
    dead, live = local / ".llmlab-tiny.staging-999999999", local / f".llmlab-tiny.staging-{os.getppid()}"
    for d in (dead, live):  # a killed stage's copy, and one that another process on the node is still making
        d.mkdir(parents=True)
        (d / "model-00001-of-00003.safetensors").write_bytes(b"half")
    weights.stage(sharded, local, progress=False)
    assert sorted(p.name for p in local.iterdir()) == sorted([live.name, *STAGED])


def test_a_job_with_a_stage_dir_loads_the_node_local_copy_after_staging_it():
    """LLMLAB_STAGE_DIR: the rendered job serves the copy in that folder and runs ``llmlab weights stage`` first."""
    from llmlab.cluster.layouts import SettingsError
    from llmlab.cluster.render import render

    job = render("llama3.1-70b", env={"LLMLAB_MODEL_DIR": "/models", "LLMLAB_STAGE_DIR": "/local/w"}, python="py")
    assert job.model_path == "/local/w/Llama-3.1-70B-Instruct"
    assert job.stage_argv == ["py", "-m", "llmlab", "weights", "stage", "/models/Llama-3.1-70B-Instruct", "--to",
                              "/local/w"]
    assert job.serve_line.split()[2] == "/local/w/Llama-3.1-70B-Instruct"
    assert "stage_argv=(py -m llmlab weights stage /models/Llama-3.1-70B-Instruct --to /local/w)" in job.shell()
    assert "copied to /local/w/Llama-3.1-70B-Instruct on each node before vLLM starts" in job.summary()
    plain = render("llama3.1-70b", env={"LLMLAB_MODEL_DIR": "/models"})
    assert plain.stage_argv == [] and "stage_argv=()" in plain.shell()
    with pytest.raises(SettingsError, match="set LLMLAB_MODEL_DIR"):
        render("llama3.1-70b", env={"LLMLAB_STAGE_DIR": "/local/w"})


def test_the_launchers_dry_run_shows_the_staging(tmp_path):
    from slurm_helpers import dry_run

    out = dry_run("llama3.1-8b", LLMLAB_MODEL_DIR="/models", LLMLAB_STAGE_DIR=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert f"weights: /models/Llama-3.1-8B-Instruct copied to {tmp_path}/Llama-3.1-8B-Instruct" in out.stdout
    serve = next(line for line in out.stdout.splitlines() if line.startswith("vLLM:"))
    assert f" {tmp_path}/Llama-3.1-8B-Instruct " in serve


def _look_alike(src: Path, dest: Path) -> None:
    """What security-review-3's F2 planted: the same names and sizes (public for a hub model), every weight zeroed
    and another chat template of the same length; safetensors headers intact, so verify passes it."""
    shutil.copytree(src, dest)
    for f in dest.glob("*.safetensors"):
        head = 8 + int.from_bytes(f.read_bytes()[:8], "little")
        data = bytearray(f.read_bytes())
        data[head:] = bytes(len(data) - head)
        f.write_bytes(bytes(data))
    template = dest / "tokenizer_config.json"
    template.write_text("x" * len(template.read_text()))


def test_a_look_alike_planted_where_the_copy_goes_is_copied_over_not_served(sharded, tmp_path, capsys):
    """F2: a tree of the right names and sizes that no stage of the caller's wrote (no manifest) is not trusted:
    the stage copies the real tree over it.  Before the fix it said "already holds a verified copy" and the room was
    served zeroed weights."""
    local = tmp_path / "local"
    local.mkdir(mode=0o700)
    _look_alike(sharded, local / "llmlab-tiny")
    assert weights.same_files(sharded, local / "llmlab-tiny")  # what the old skip compared
    done = weights.stage(sharded, local, progress=False)
    assert not done["skipped"]
    for f in weights._files(sharded):
        assert (local / "llmlab-tiny" / f.relative_to(sharded)).read_bytes() == f.read_bytes(), f.name


def test_a_staged_copy_changed_afterwards_is_staged_again(sharded, tmp_path):
    """The manifest written at the copy (owner, size, mtime, inode of every file) must still match: a shard
    rewritten in place with bytes of the same size is noticed, and replaced."""
    local = tmp_path / "local"
    weights.stage(sharded, local, progress=False)
    target = shard(local / "llmlab-tiny", 2)
    data = bytearray(target.read_bytes())
    data[-64:] = bytes(64)
    target.write_bytes(bytes(data))
    assert weights.verify(local / "llmlab-tiny", group=False).ok  # headers and sizes cannot tell
    assert not weights.stage(sharded, local, progress=False)["skipped"]
    assert target.read_bytes() == shard(sharded, 2).read_bytes()


@pytest.mark.parametrize("where", ["the stage folder", "a folder above it"])
def test_a_stage_folder_others_can_write_is_refused_with_the_fix(sharded, tmp_path, where):
    """F2: the folder the copy goes to, and every folder above it, must be the caller's and writable by nobody else
    (or root's and not writable by others unless sticky, as /tmp): else someone could swap the copy after the
    stage.  Before the fix the stage copied into any folder."""
    parent = tmp_path / "scratch"
    local = parent / "weights"
    local.mkdir(parents=True)
    (local if where == "the stage folder" else parent).chmod(0o777)
    refused = r"can be (written by its group or others|changed by others).*only you can write"
    with pytest.raises(weights.WeightsError, match=refused):
        weights.stage(sharded, local, progress=False)
    assert not (local / "llmlab-tiny").exists()
    assert cli.main(["weights", "stage", str(sharded), "--to", str(local)]) == 2


def test_missing_stage_folders_are_made_private(sharded, tmp_path):
    local = tmp_path / "scratch" / "me" / "weights"
    weights.stage(sharded, local, progress=False)
    assert stat.S_IMODE(local.stat().st_mode) == 0o700 and stat.S_IMODE(local.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((local / "llmlab-tiny" / weights.MANIFEST).stat().st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder or a link to another user needs root (CI runs as root)")
@pytest.mark.parametrize("planted", ["a folder", "a symbolic link"])
def test_a_stage_folder_planted_by_another_user_is_refused(sharded, tmp_path, planted):
    """F2, variant B: another user made the stage folder first (a public name in a 1777 scratch disk), or a link by
    that name to a folder of the instructor's.  The stage refuses, naming the owner."""
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o777)
    scratch.chmod(0o1777)  # sticky, as /local/scratch and /tmp are
    local = scratch / "weights"
    if planted == "a folder":
        local.mkdir()
        os.chown(local, 65534, 65534)
    else:
        mine = tmp_path / "mine"
        mine.mkdir(mode=0o700)
        local.symlink_to(mine)
        os.lchown(local, 65534, 65534)
    with pytest.raises(weights.WeightsError, match=r"(belongs to|symbolic link made by) (user nobody|uid 65534)"):
        weights.stage(sharded, local, progress=False)


def test_unstage_removes_a_copy_stage_made_and_what_a_killed_stage_left(sharded, tmp_path, capsys):
    """After the workshop the 141 GB copies stayed on the nodes' disks (no clean-up step): unstage removes the
    copy, and a second run (a teardown on every node) has nothing to do."""
    local = tmp_path / "local"
    weights.stage(sharded, local, progress=False)
    (local / ".llmlab-tiny.staging-999999999").mkdir()  # a killed stage's leftover
    assert cli.main(["weights", "unstage", str(local / "llmlab-tiny")]) == 0
    assert f"removed the staged copy {local / 'llmlab-tiny'}: 0.01 GB freed" in capsys.readouterr().out
    assert list(local.iterdir()) == [] and weights.verify(sharded).ok
    assert cli.main(["weights", "unstage", str(local / "llmlab-tiny")]) == 0
    assert "no staged copy here, nothing to remove" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["no manifest", "a file added", "the stage folder"])
def test_unstage_removes_nothing_stage_did_not_make(sharded, tmp_path, capsys, case):
    """Only a copy whose private manifest proves it is the stage's: the shared tree itself, a copy someone added
    a file to, or the stage folder given by mistake stay, with the sentence saying why and what to give."""
    local = tmp_path / "local"
    weights.stage(sharded, local, progress=False)
    target = {"no manifest": sharded, "a file added": local / "llmlab-tiny", "the stage folder": local}[case]
    if case == "a file added":
        (target / "notes.txt").write_text("mine")
    before = sorted(p for p in target.rglob("*"))
    assert cli.main(["weights", "unstage", str(target)]) == 2
    err = capsys.readouterr().err
    assert "so it is not a copy `llmlab weights stage` made and nothing is removed" in err
    assert sorted(p for p in target.rglob("*")) == before
    why = {"no manifest": f"holds no stage manifest ({weights.MANIFEST})",
           "a file added": "holds files the stage did not copy (notes.txt)",
           "the stage folder": f"; it holds {local / 'llmlab-tiny'}, or remove it yourself"}[case]
    assert why in err
