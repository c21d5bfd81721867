"""``llmlab weights``: a model's weights planned, fetched, verified and staged before the room needs them.

Why: what costs a workshop is found at load time -- a half-downloaded shard, files the learners' group cannot
read, a large job reading a network file system for its first minutes.  Each is cheap to find the day before:

- :func:`plan`: files, bytes and dtype of a model directory (its ``config.json`` and safetensors index) or of a
  model llmlab knows (``llmlab.memory``'s parameter count x the checkpoint's dtype), and whether it fits a folder;
- :func:`fetch`: huggingface_hub's own ``snapshot_download`` (resumable: an interrupted run picks up where it
  stopped) of only the files vLLM reads, into a tree the group can read;
- :func:`verify`: every shard the index names is there, of the size its safetensors header says, its tensors'
  names and shapes those of the config (the parameter count equals ``llmlab.memory.param_count``), in the config's
  dtype, readable by the group -- one sentence per problem, naming the file and the fix;
- :func:`stage`: a copy to node-local disk, timed, atomic (a temporary name, then one rename), into a folder only
  the caller can write, skipped only when the copy there is the one a stage made (its private manifest matches);
  :func:`unstage` removes such a copy, and only such a copy, after the workshop.

The arithmetic (parameters, bytes per dtype) is ``llmlab.memory``'s; this module only reads files and the hub.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import json
import logging
import math
import os
import random
import shutil
import stat
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from llmlab import memory

# What vLLM reads from a Hugging Face model repository; the rest (original/*.pth, consolidated.safetensors of the
# Mistral format, *.bin duplicates of the safetensors, READMEs of images) is not downloaded.
VLLM_FILES = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
              "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
              "added_tokens.json", "vocab.json", "merges.txt", "*.tiktoken", "chat_template.json", "*.jinja"]
IGNORED = ["original/*", "consolidated*.safetensors", "*/consolidated*.safetensors"]
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
RECORD = "llmlab-weights.json"  # what fetch wrote: the repository and revision, so verify can name the re-fetch
SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB") when it saves a checkpoint
DIR_MODE, FILE_MODE = 0o2750, 0o640  # group-readable, nobody else; setgid keeps the group on what is added later
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "fp8", "F8_E5M2": "fp8",
                      "I8": "int8", "U8": "uint8", "I32": "int32", "I64": "int64", "F64": "float64",
                      "BOOL": "bool", "I16": "int16", "U16": "uint16", "U32": "uint32", "U64": "uint64"}
MAX_HEADER = 100 * 2**20  # the safetensors format's own limit on a header


class WeightsError(Exception):
    """An expected failure (gated model, no network, no space, not a model folder): the message says the fix."""


# --------------------------------------------------------------------------------------------------
# Reading a safetensors file's header (the only part verify and plan read)
# --------------------------------------------------------------------------------------------------

@dataclass
class Header:
    """One safetensors file's header: its tensors (name -> dtype, shape, data offsets) and the size it implies."""

    tensors: dict[str, dict]
    header_bytes: int

    @property
    def expected_size(self) -> int:
        """8 bytes of length, the JSON header, then the data up to the last tensor's end offset."""
        end = max((t["data_offsets"][1] for t in self.tensors.values()), default=0)
        return 8 + self.header_bytes + end


def read_header(path: Path) -> Header:
    """Parse the header of ``path``; raise ``ValueError`` with what is wrong (too short, not JSON, bad offsets)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"it has {len(head)} bytes, fewer than the 8 of a safetensors header's length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise ValueError(f"its first 8 bytes give a header of {n:,} bytes, more than safetensors allows: "
                             "not a safetensors file, or its start is overwritten")
        raw = f.read(n)
    if len(raw) < n:
        raise ValueError(f"it ends inside its {n:,}-byte header")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"its header is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError("its header is not a JSON object")
    data.pop("__metadata__", None)
    for name, t in data.items():
        ok = (isinstance(t, dict) and isinstance(t.get("shape"), list) and isinstance(t.get("dtype"), str)
              and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
              and all(isinstance(x, int) and x >= 0 for x in t["data_offsets"] + t["shape"])
              and t["data_offsets"][0] <= t["data_offsets"][1])
        if not ok:
            raise ValueError(f"its header's entry for {name!r} has no valid dtype, shape and data_offsets")
    return Header(data, n)


# --------------------------------------------------------------------------------------------------
# A model directory: its shards, and what is wrong with it
# --------------------------------------------------------------------------------------------------

def shard_names(root: Path) -> tuple[list[str], dict[str, str] | None]:
    """(the shards, the index's tensor -> shard map or None): the index's shards where there is one, else every
    ``*.safetensors`` file of the folder."""
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"{index} is not a safetensors index with a weight_map ({e}): fetch it again.") from None
        return sorted(set(weight_map.values())), weight_map
    return sorted(p.name for p in root.glob("*.safetensors")), None


def _group_readable(path: Path) -> bool:
    mode = path.stat().st_mode
    need = stat.S_IRGRP | (stat.S_IXGRP if stat.S_ISDIR(mode) else 0)
    return mode & need == need


def _closed_parents(root: Path) -> list[Path]:
    """The folders above ``root`` that a member of the tree's group (not their owner) cannot pass through: neither
    o+x, nor of the tree's group with g+x.  A learner's or co-instructor's job meets them as a permission error at
    load time; the tree's own modes do not help."""
    gid = root.stat().st_gid
    closed = []
    for part in root.absolute().parents:
        st = part.stat()
        if not (st.st_mode & stat.S_IXOTH or (st.st_gid == gid and st.st_mode & stat.S_IXGRP)):
            closed.append(part)
    return closed


def _group_name(path: Path) -> str:
    gid = path.stat().st_gid
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


@dataclass
class Verdict:
    """What :func:`verify` found: ``problems`` (one sentence each; none means the tree is good) and the facts."""

    root: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    shards: int = 0
    bytes: int = 0
    params: int = 0
    expected_params: int | None = None
    dtypes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {"root": self.root, "ok": self.ok, "problems": self.problems, "notes": self.notes,
                "shards": self.shards, "bytes": self.bytes, "params": self.params,
                "expected_params": self.expected_params, "dtypes": self.dtypes}


def _refetch(root: Path) -> str:
    """The command that fetches this tree again, from the record fetch left (else a placeholder for the repo)."""
    try:
        repo = json.loads((root / RECORD).read_text())["repo"]
    except (OSError, ValueError, KeyError, TypeError):
        repo = "REPO"
    return f"`llmlab weights fetch {repo} --to {root}`"


def _names(names: list[str], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def verify(root, spec=None, *, group: bool = True) -> Verdict:
    """Check a model directory as vLLM will read it, and as the learners' group will.

    Every shard the index names (or every ``*.safetensors`` without one) must exist, have a header that parses,
    and be exactly as long as its header's data offsets say; the tensors of all shards together must be the ones
    ``llmlab.memory.tensors`` lists for the config, with the same shapes, so that the parameter count from the
    headers equals ``llmlab.memory.param_count``, in the config's dtype; every file and folder must be readable by
    the group.  Tied embeddings: ``memory`` counts the embedding once and lists no ``lm_head.weight``; a checkpoint
    that stores one anyway (some tied ones do) passes when its shape is the embedding's, and it is not counted
    twice.  A quantized checkpoint (fp8 scales, mxfp4 blocks) stores other names: its names are not compared.
    ``spec``: a ModelSpec or config to compare with (default: the folder's config.json); ``group=False``: the
    modes are not checked (a node-local copy that only the job's user reads).
    """
    root = Path(root)
    v = Verdict(str(root))
    fix_modes = f"`chmod -R g+rX {root}` (or `llmlab weights fetch` again, which sets the modes)"
    if not root.is_dir():
        v.problems.append(f"{root} is not a folder: fetch the model there first ({_refetch(root)}).")
        return v
    refetch = _refetch(root)
    try:
        spec = memory.model_spec(spec if spec is not None else root)
    except memory.UnsupportedArchitecture as e:
        spec = None
        v.notes.append(f"names, shapes and the parameter count are not compared: {e}")
    except memory.ConfigError as e:
        v.problems.append(f"{root / 'config.json'}: {e}")
        spec = None
    if not any((root / t).is_file() for t in TOKENIZER_FILES):
        v.problems.append(f"{root} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): vLLM needs one; "
                          f"fetch again with {refetch}.")
    unreadable = [p for p in [root, *root.rglob("*")] if group and not p.is_symlink() and not _group_readable(p)
                  and p.name != MANIFEST]  # a stage's own record, private on purpose
    for p in unreadable[:5]:
        v.problems.append(f"{p} is not readable by the group ({stat.filemode(p.stat().st_mode)}): {fix_modes}.")
    if len(unreadable) > 5:
        v.problems.append(f"... and {len(unreadable) - 5} more files or folders not readable by the group: "
                          f"{fix_modes}.")
    if group and (closed := _closed_parents(root)):
        name = _group_name(root)
        shown = _names([f"{p} ({stat.filemode(p.stat().st_mode)})" for p in closed])
        v.notes.append(f"the group {name} may not reach this tree: the folder(s) above it {shown} let no member of "
                       f"{name} through; if a co-instructor's or a learner's job reads these weights, "
                       f"`chmod o+x {closed[0]}` (or give it group {name} and g+x); your own jobs do not need it")
    try:
        shards, weight_map = shard_names(root)
    except WeightsError as e:
        v.problems.append(str(e))
        return v
    if not shards:
        v.problems.append(f"{root} has no *.safetensors file: fetch the weights with {refetch}.")
        return v
    found: dict[str, dict] = {}
    where: dict[str, str] = {}
    for name in shards:
        path = root / name
        if not path.is_file():
            v.problems.append(f"{path} is missing (the index names it): fetch it again with {refetch}.")
            continue
        v.shards += 1
        size = path.stat().st_size
        v.bytes += size
        try:
            header = read_header(path)
        except PermissionError:
            v.problems.append(f"{path} cannot be read by you: `chmod u+r {path}`.")
            continue
        except ValueError as e:
            v.problems.append(f"{path}'s safetensors header is corrupt: {e}; delete it and fetch it again with "
                              f"{refetch}.")
            continue
        if size != header.expected_size:
            what = "truncated" if size < header.expected_size else "longer than its header says"
            v.problems.append(f"{path} is {what}: {size:,} bytes where its header's data offsets need "
                              f"{header.expected_size:,}; delete it and fetch it again with {refetch}.")
        for tname, t in header.tensors.items():
            found[tname] = t
            where[tname] = name
    if weight_map is not None:
        unlisted = sorted(n for n in weight_map if n not in found and (root / weight_map[n]).is_file())
        if unlisted:
            v.problems.append(f"the index {root / INDEX} places {_names(unlisted)} in shards whose headers do not "
                              f"hold them: the index and the shards come from different revisions; fetch again "
                              f"with {refetch}.")
    v.dtypes = sorted({SAFETENSORS_DTYPES.get(t["dtype"], t["dtype"]) for t in found.values()})
    v.params = sum(math.prod(t["shape"]) for t in found.values())
    if spec is None:
        return v
    _compare(v, spec, found, where, root)
    return v


def _compare(v: Verdict, spec, found: dict[str, dict], where: dict[str, str], root: Path) -> None:
    """Names, shapes, parameter count and dtype of the headers' tensors against ``llmlab.memory``'s."""
    v.expected_params = memory.param_count(spec)
    embed = "model.embed_tokens.weight"
    if spec.tie_word_embeddings and "lm_head.weight" in found:
        tied = found.pop("lm_head.weight")
        if embed in found and tied["shape"] == found[embed]["shape"]:
            v.notes.append("lm_head.weight is stored although the embeddings are tied: vLLM uses the embedding, so "
                           "it is counted once")
            v.params -= math.prod(tied["shape"])
        else:
            found["lm_head.weight"] = tied
    if spec.quant_method is not None:
        v.notes.append(f"a {spec.quant_method} checkpoint stores scales beside its weights under other names: names "
                       "and shapes not compared")
        return
    expected = {t.name: list(t.shape) for t in memory.tensors(spec)}
    missing = sorted(n for n in expected if n not in found)
    extra = sorted(n for n in found if n not in expected)
    wrong = sorted(n for n in expected if n in found and found[n]["shape"] != expected[n])
    if missing:
        v.problems.append(f"{len(missing)} tensor(s) of the config are in no shard ({_names(missing)}): the "
                          f"checkpoint is not the config's model, or a shard is missing; fetch again with "
                          f"{_refetch(root)}.")
    if extra:
        v.problems.append(f"{len(extra)} tensor(s) in the shards are not in the config's model ({_names(extra)}, in "
                          f"{where[extra[0]]}): config.json and the weights come from different models.")
    for n in wrong[:3]:
        v.problems.append(f"{where[n]}: {n} has shape {found[n]['shape']}, the config gives {expected[n]}: "
                          "config.json and the weights come from different models.")
    if not missing and not extra and not wrong and v.params != v.expected_params:  # cannot happen; a guard
        v.problems.append(f"the headers hold {v.params:,} parameters, llmlab.memory counts {v.expected_params:,}.")
    want = spec.torch_dtype
    other = sorted({f"{where[n]}: {n} ({SAFETENSORS_DTYPES.get(t['dtype'], t['dtype'])})" for n, t in found.items()
                    if want and SAFETENSORS_DTYPES.get(t["dtype"]) != want})
    if other:
        v.problems.append(f"{len(other)} tensor(s) are not in the config's dtype {want} ({_names(other, 2)}): "
                          "vLLM would cast them; fix config.json's torch_dtype or fetch the weights again.")


# --------------------------------------------------------------------------------------------------
# Plan: what a model needs on disk, and whether it fits where it is going
# --------------------------------------------------------------------------------------------------

def _free_bytes(path: Path) -> tuple[Path, int]:
    """Free bytes on the file system that holds ``path`` (or would: its nearest existing parent)."""
    p = path.expanduser().absolute()
    while not p.exists():
        p = p.parent
    return p, shutil.disk_usage(p).free


# shutil.disk_usage gives the file system's free bytes; on a shared file system the user's or project's quota is
# usually the real limit (141 GB passed with 500 TB free, then EDQUOT mid-download), and no portable call reads it:
# the sentences name the command that shows it, by the file system's type in /proc/mounts.
ANY_QUOTA = "`lfs quota -u $USER DIR` on Lustre, `mmlsquota` on GPFS, `quota -s` elsewhere"


def _mount_of(path, mounts: str = "/proc/mounts") -> tuple[str, str] | None:
    """(mount point, file system type) of the mount that holds ``path`` (the longest mount point above it), or
    None where the mount table cannot be read."""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    real, best = os.path.realpath(path), None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and (best is None or len(point) >= len(best[0])):
            best = (point, fields[2])
    return best


def quota_command(path, mounts: str = "/proc/mounts") -> str:
    """The command that shows your quota on the file system of ``path``: Lustre's ``lfs quota``, GPFS's
    ``mmlsquota``, else ``quota -s``; all three where the mount table cannot be read."""
    found = _mount_of(path, mounts)
    if found is None:
        return ANY_QUOTA
    point, kind = found
    if kind == "lustre":
        return f"`lfs quota -u $USER {point}` (`lfs quota -p PROJECT {point}` for a project's)"
    return "`mmlsquota`" if kind == "gpfs" else "`quota -s`"


def _free(where: Path, free: int) -> str:
    """The free bytes, said as what they are: the file system's, not your quota."""
    return (f"{free / 1e9:,.1f} GB free on {where} (the file system's free bytes; your quota may be less: "
            f"{quota_command(where)} shows it)")


def _known(model: str) -> str | None:
    """A model llmlab knows: a shipped name, or the Hugging Face id behind one."""
    if model in memory.shipped_models():
        return model
    by_id = {hf: name for name, hf in memory.HF_IDS.items()}
    return by_id.get(model)


def plan(model, to=None) -> dict:
    """Files, bytes and dtype of a model, and whether it fits ``to``.

    A directory: its files as they are (the index's ``total_size`` beside the shards' sizes).  A model llmlab knows
    (a shipped name or its Hugging Face id): an estimate -- ``llmlab.memory.weight_bytes`` (parameters x the
    checkpoint's dtype, fp8 scales included) in shards of up to 5 GB, transformers' default; the repository's own
    split may differ by a shard, its bytes by the headers (kilobytes).
    """
    path = Path(str(model)).expanduser()
    out: dict = {"model": str(model)}
    if path.is_dir():
        spec = memory.model_spec(path)
        shards, weight_map = shard_names(path)
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.relative_to(path).parts[0].startswith("."))
        out.update(source="directory", files=[{"name": str(p.relative_to(path)), "bytes": p.stat().st_size}
                                              for p in files],
                   shards=len(shards), bytes=sum(p.stat().st_size for p in files), exact=True)
        if weight_map is not None:
            out["index_total_size"] = json.loads((path / INDEX).read_text()).get("metadata", {}).get("total_size")
        out["repo"] = None
    else:
        name = _known(str(model))
        if name is None:
            raise WeightsError(f"{model!r} is neither a model folder nor a model llmlab knows "
                               f"({', '.join(memory.shipped_models())}, or their Hugging Face ids): give a folder, "
                               "or fetch it first and plan the folder.")
        spec = memory.model_spec(name)
        weights = memory.weight_bytes(spec)
        n = max(1, -(-weights // SHARD_BYTES))
        names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        out.update(source="estimate", files=[{"name": f, "bytes": None} for f in names + ([INDEX] if n > 1 else [])],
                   shards=n, bytes=weights, exact=False, repo=spec.hf_id)
    out.update(params=memory.param_count(spec), dtype=spec.torch_dtype, quantization=spec.quant_method,
               architecture=spec.architecture)
    if to is not None:
        where, free = _free_bytes(Path(to))
        out.update(to=str(to), free_bytes=free, free_on=str(where), fits=free >= out["bytes"],
                   quota_command=quota_command(where))
    return out


# --------------------------------------------------------------------------------------------------
# Fetch: huggingface_hub's own download, then modes the group can read
# --------------------------------------------------------------------------------------------------

def check_group(group: str | None) -> int:
    """The gid of ``group`` (-1 for none), checked before anything is downloaded: the group exists here and you
    are in it, else giving it the tree fails -- found after a 141 GB download when it was checked last.  Root may
    give a file any group."""
    if group is None:
        return -1
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise WeightsError(f"there is no UNIX group {group!r} here: ask the admins for the class's group, or "
                           "leave --group out to keep the folder's own.") from None
    if os.geteuid() != 0 and gid not in (os.getegid(), *os.getgroups()):
        raise WeightsError(f"you are not in the UNIX group {group!r} (`id -Gn` lists yours), so the tree cannot be "
                           "given to it: ask the admins to add you and log in again, or leave --group out.")
    return gid


def make_group_readable(root, group: str | None = None) -> str:
    """Folders ``2750`` (the group may list and enter; setgid: what is added later keeps the group), files
    ``0640`` (the group reads, nobody else); with ``group``, the tree's group too.  Returns a sentence saying what
    it did, for the group it ended up with."""
    root = Path(root)
    gid = check_group(group)
    dirs = files = 0
    for p in [root, *root.rglob("*")]:
        try:  # through an fd opened without following a link: a link swapped in after the walk is not followed
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            if e.errno == errno.ELOOP:
                continue  # a symbolic link: not ours to change
            raise WeightsError(f"cannot open {p} ({e.strerror}): you must own the tree.") from None
        try:
            is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
            if gid != -1:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, DIR_MODE if is_dir else FILE_MODE)
        except PermissionError as e:
            raise WeightsError(f"cannot set the group or mode of {p} ({e.strerror}): you must own it and be in "
                               f"group {group or 'its group'} (`id -Gn`).") from None
        finally:
            os.close(fd)
        dirs, files = (dirs + 1, files) if is_dir else (dirs, files + 1)
    name = grp.getgrgid(root.stat().st_gid).gr_name
    return (f"{dirs} folder(s) {DIR_MODE:o} and {files} file(s) {FILE_MODE:o}, group {name}"
            f"{'' if group else ' (the folder' + chr(39) + 's own; --group GROUP to change it)'}")


GATED = ("{repo} is gated: accept its licence on https://huggingface.co/{repo} with your account, then log in here "
         "with `hf auth login` (or export HF_TOKEN=<a read token>) and fetch again.")


def explain_hub_error(e: BaseException, repo: str) -> str | None:
    """One sentence for the hub's expected failures (gated, not found, no network), or None for anything else."""
    import httpx2
    from huggingface_hub import errors

    if isinstance(e, errors.GatedRepoError):
        return GATED.format(repo=repo)
    if isinstance(e, errors.RepositoryNotFoundError):
        return (f"{repo} is not on the hub, or is private to an account this machine is not logged in as: check the "
                "name (Owner/Model), and for a private model `hf auth login` or HF_TOKEN.")
    if isinstance(e, errors.HfHubHTTPError) and e.response is not None and e.response.status_code in (401, 403):
        return GATED.format(repo=repo)
    if isinstance(e, errors.LocalEntryNotFoundError | errors.OfflineModeIsEnabled | httpx2.ConnectError
                  | httpx2.TimeoutException):
        return (f"the hub cannot be reached from here ({type(e).__name__}), so {repo} cannot be fetched: fetch "
                "from a machine with network (a login node, not a compute node), or unset HF_HUB_OFFLINE.")
    if isinstance(e, errors.IncompleteSnapshotError):  # its cause says why the hub did not answer: a 401 is gated
        cause = e.__cause__ and explain_hub_error(e.__cause__, repo)
        return cause or (f"the download of {repo} is incomplete and the hub cannot be reached: run the same fetch "
                         "again later.")
    return None


def _from_hub(call, repo_id: str):
    """``call()``, its expected failures raised as :class:`WeightsError` with :func:`explain_hub_error`'s sentence."""
    try:
        return call()
    except Exception as e:
        why = explain_hub_error(e, repo_id)
        if why is None:
            raise
        raise WeightsError(why) from None


def check_access(repo_id: str, *, token=None, endpoint: str | None = None) -> None:
    """The hub's own access check (``HfApi.auth_check``) before anything is downloaded: a licence not accepted, a
    token expired or missing, a name misspelt is said now, in one sentence, and not after (or instead of) the
    download."""
    from huggingface_hub import HfApi

    _from_hub(lambda: HfApi(endpoint=endpoint, token=token).auth_check(repo_id), repo_id)


# huggingface_hub's snapshot_download, when it cannot list the repository and ``local_dir`` already holds files,
# returns that folder with only this warning (huggingface_hub 2.4, _snapshot_download.py): a resumed fetch whose
# token had expired "succeeded", and verify then sent the instructor back to fetch.
HIDDEN_FAILURE = "as remote repo cannot be accessed"


@contextlib.contextmanager
def _hub_warnings():
    """The warnings snapshot_download logs while the block runs (at WARNING whatever HF_HUB_VERBOSITY says)."""
    caught: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: caught.append(record.getMessage())
    logger = logging.getLogger("huggingface_hub._snapshot_download")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield caught
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _download(repo_id: str, to: Path, *, revision, token, endpoint) -> None:
    """snapshot_download of the files vLLM reads; a listing that failed behind a warning is raised, never a
    success: the access is checked again (an expired token reads as the gated sentence), else the hub's own words."""
    from huggingface_hub import snapshot_download

    with _hub_warnings() as warned:
        _from_hub(lambda: snapshot_download(repo_id, local_dir=to, revision=revision, token=token, endpoint=endpoint,
                                            allow_patterns=VLLM_FILES, ignore_patterns=IGNORED), repo_id)
    hidden = [w for w in warned if HIDDEN_FAILURE in w]
    if hidden:
        check_access(repo_id, token=token, endpoint=endpoint)
        raise WeightsError(f"the hub did not list the files of {repo_id} ({hidden[0]}), so nothing was fetched or "
                           f"checked: run the same fetch again when the hub answers.")


def _check_space(repo_id: str, to: Path, say) -> None:
    """For a model llmlab knows: refuse before the download when its estimate does not fit in the free bytes left
    (what ``to`` holds already counts: a resume)."""
    name = _known(repo_id)
    if not name:
        return
    estimate = plan(name, to)
    where, free = Path(estimate["free_on"]), estimate["free_bytes"]
    say(f"{repo_id}: about {estimate['bytes'] / 1e9:,.1f} GB ({estimate['dtype']}); {_free(where, free)}")
    present = sum(p.stat().st_size for p in to.rglob("*") if p.is_file()) if to.is_dir() else 0  # a resume
    if free < estimate["bytes"] - present:
        raise WeightsError(f"{repo_id} needs about {estimate['bytes'] / 1e9:,.1f} GB ({present / 1e9:,.1f} GB of it "
                           f"already there) and {where} has {free / 1e9:,.1f} GB free: choose another --to, or free "
                           f"space (and your quota may be less than the free bytes: {quota_command(where)} shows it).")


def _check_writable(to: Path) -> None:
    """A fetch adds to ``to`` and the hub's resume metadata in ``to/.cache/huggingface``: refused in one sentence
    when someone else's (a co-instructor resuming): the tree stays 2750, writable by its owner only, because the
    learners are in its group and could otherwise change the weights the room is served."""
    for p in (to, to / ".cache" / "huggingface"):
        if p.is_dir() and not os.access(p, os.W_OK | os.X_OK):
            owner = _owner(p.stat().st_uid)
            raise WeightsError(f"{p} belongs to {owner} and you cannot write in it "
                               f"({stat.filemode(p.stat().st_mode)}), so this fetch cannot resume or add to it: ask "
                               f"{owner} to run the same fetch, or fetch into a folder of your own.")


def hf_home() -> str:
    """Where the hub's client keeps your token and its Xet cache, and the fix where that is a small home: its own
    HF_HOME (``huggingface_hub.constants``), said before a download that fills it."""
    from huggingface_hub import constants

    home = Path(constants.HF_HOME)
    said = f"the hub's client keeps your token and its Xet cache in HF_HOME={home}, {_free(*_free_bytes(home))}"
    if home.absolute().is_relative_to(Path.home()):
        said += ("; on a small home quota, export HF_HOME=/scratch/$USER/hf before fetching (and log in there again "
                 "with `hf auth login`, or export HF_TOKEN)")
    return said


def fetch(repo: str, to, *, group: str | None = None, revision: str | None = None, token: str | None = None,
          endpoint: str | None = None, say=print) -> dict:
    """Download the files vLLM reads of ``repo`` (a Hugging Face id, or a shipped name) into ``to``.

    First what would stop it after hours, each in one sentence: the group (:func:`check_group`), a folder that is
    another user's (:func:`_check_writable`), where the hub's client caches (:func:`hf_home`), the space (with the
    command that shows the quota), the access (:func:`check_access`).  Then
    ``huggingface_hub.snapshot_download(local_dir=to)``: an interrupted run resumes its partial files
    (``to/.cache/huggingface`` keeps what it needs), a complete one returns at once; a
    listing that failed is an error (:func:`_download`).  Then the modes (:func:`make_group_readable`) and
    :func:`verify`.  ``endpoint``: another hub (a mirror; tests use a local one); ``token``: default HF_TOKEN or
    ``hf auth login``'s.
    """
    repo_id = memory.HF_IDS.get(repo, repo)
    to = Path(to)
    check_group(group)
    _check_writable(to)
    say(hf_home())
    _check_space(repo_id, to, say)
    check_access(repo_id, token=token, endpoint=endpoint)
    started = time.monotonic()
    _download(repo_id, to, revision=revision, token=token, endpoint=endpoint)
    seconds = time.monotonic() - started
    (to / RECORD).write_text(json.dumps({"repo": repo_id, "revision": revision, "fetched": time.time()}) + "\n")
    modes = make_group_readable(to, group)
    verdict = verify(to)
    return {"repo": repo_id, "to": str(to), "seconds": seconds, "modes": modes, "verify": verdict.as_dict()}


# --------------------------------------------------------------------------------------------------
# Stage: a copy on node-local disk, timed, atomic, skipped when already there
# --------------------------------------------------------------------------------------------------

CHUNK = 16 * 2**20


def _files(root: Path) -> list[Path]:
    """The files of a model tree that vLLM reads (hidden folders such as the hub's .cache left out)."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(root).parts))


def same_files(a: Path, b: Path) -> bool:
    """Same relative names and sizes (the content is verify's: headers and sizes)."""
    def listing(root):
        return [(str(p.relative_to(root)), p.stat().st_size) for p in _files(root)]
    return listing(a) == listing(b)


def _remove_stale(to: Path, name: str) -> None:
    """Temporary copies of ``name`` left in ``to`` by a stage that was killed (its process is gone): their names
    are ``.NAME.staging-PID.RANDOM`` (``tempfile.mkdtemp``) or ``.NAME.old-PID``."""
    for p in to.glob(f".{name}.*-*"):
        try:
            os.kill(int(p.name.rsplit("-", 1)[1].split(".")[0]), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, PermissionError):
            continue  # not a pid, or another user's live process


# The stage folder and its copies: only the caller may change them.  Why: a node-local scratch disk is usually
# world-writable (1777), and a name such as /local/scratch/$USER/weights is public; anyone who makes that folder
# first, or plants a tree of the right names and sizes in it, would choose the weights and chat template the whole
# room is served (security-review-3, F2).


class Use(NamedTuple):
    """What a private folder is for, in its refusal's words (:func:`private_folder`): what was refused (``{}``: the
    folder), what someone else could do with the folder, and the fix."""

    refused: str
    risk: str
    fix: str


STAGE = Use("stage weights into {}", "someone else could choose the weights the room is served",
            "Stage into a folder only you can write, e.g. LLMLAB_STAGE_DIR=/local/scratch/$USER/weights")
# vLLM's compile cache and the Hugging Face cache (LLMLAB_CACHE_DIR): code vLLM loads and runs, and the weights and
# chat template it serves when the model is named by its id, so the same rule as the stage folder.
CACHE = Use("use {} as LLMLAB_CACHE_DIR", "someone else could change the compiled code and the model files vLLM "
            "loads from it", "Set LLMLAB_CACHE_DIR to a folder only you can write, e.g. one in your home or your "
            "own folder of the shared file system")


def private_folder(to, use: Use = STAGE) -> Path:
    """``to``, made if missing (0700), after checking that nobody but the caller (and root) can change it or any
    folder above it: each existing folder is root's and not writable by others (or sticky, as /tmp is), or the
    caller's and writable by nobody else; a symbolic link on the way must be root's or the caller's.  Returns the
    real path.  Raises :class:`WeightsError` naming the folder and the fix (``use`` says what the folder is for)."""
    path = Path(os.path.abspath(Path(to).expanduser()))
    for part in (path, *path.parents):
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(part)
            if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.geteuid()):
                raise WeightsError(_unsafe(path, f"{part} is a symbolic link made by {_owner(st.st_uid)}", use))
    real = Path(os.path.realpath(path))
    for part in reversed((real, *real.parents)):
        try:
            st = os.stat(part)
        except FileNotFoundError:
            os.mkdir(part, 0o700)
            st = os.stat(part)
        if why := _unsafe_folder(part, st):
            raise WeightsError(_unsafe(path, why, use))
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):  # the folder itself: the caller's
        raise WeightsError(_unsafe(path, f"{real} is not a folder of yours that only you can write", use))
    return real


def _unsafe_folder(part: Path, st: os.stat_result) -> str | None:
    """Why someone other than the caller and root could change what is in ``part``, or None."""
    others_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if not stat.S_ISDIR(st.st_mode):
        return f"{part} is not a folder"
    if st.st_uid == 0:
        if others_write and not st.st_mode & stat.S_ISVTX:
            return f"{part} (root's) can be changed by others: mode {stat.S_IMODE(st.st_mode):o}, not sticky"
    elif st.st_uid != os.geteuid():
        return f"{part} belongs to {_owner(st.st_uid)}"
    elif others_write:
        return f"{part} can be written by its group or others (mode {stat.S_IMODE(st.st_mode):o}): chmod go-w it"
    return None


def _unsafe(asked: Path, why: str, use: Use) -> str:
    return (f"Cannot {use.refused.format(asked)}: {why}, so {use.risk}. {use.fix} (llmlab makes the missing folders "
            "0700).")


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"


# Inside the copy, so that the copy and its manifest are renamed into place together (a node that finds the tree
# there finds its manifest too); a hidden name, which vLLM never reads and _files leaves out.
MANIFEST = ".llmlab-stage-manifest.json"


def _manifest_path(dest: Path) -> Path:
    return dest / MANIFEST


def _listing(dest: Path) -> dict[str, list[int]]:
    """Each file of the copy (links included, as links) with its owner, size, mtime in ns and inode: what a stage
    records at the copy, and what the next stage compares before it trusts the copy."""
    out = {}
    for p in sorted(dest.rglob("*")):
        if p.name == MANIFEST and p.parent == dest:
            continue
        st = os.lstat(p)
        if not stat.S_ISDIR(st.st_mode):
            kind = "file" if stat.S_ISREG(st.st_mode) else "other"
            out[str(p.relative_to(dest))] = [kind, st.st_uid, st.st_size, st.st_mtime_ns, st.st_ino]
    return out


def _write_manifest(dest: Path) -> None:
    """The copy's listing in a 0600 file inside it (replaced whole: written to a new name, then renamed)."""
    path, listing = _manifest_path(dest), _listing(dest)  # the listing first: the temporary file is not the copy's
    fd, tmp = tempfile.mkstemp(dir=dest, prefix=f"{MANIFEST}.")
    with os.fdopen(fd, "w") as f:  # mkstemp makes it 0600
        json.dump(listing, f)
    os.replace(tmp, path)


def trusted_copy(src: Path, dest: Path) -> bool:
    """Is ``dest`` the copy a stage made of ``src``, unchanged since?  The manifest is the caller's own 0600 file,
    the tree the caller's and writable by nobody else, every file's owner, size, mtime and inode as recorded, the
    names and sizes those of ``src``, and the copy verifies.  Names and sizes alone are public for a hub model."""
    try:
        st, mst = os.lstat(dest), os.lstat(_manifest_path(dest))
        if not (stat.S_ISDIR(st.st_mode) and stat.S_ISREG(mst.st_mode)) or os.geteuid() not in (st.st_uid, mst.st_uid):
            return False
        if st.st_uid != mst.st_uid or stat.S_IMODE(mst.st_mode) != 0o600 or st.st_mode & 0o022:
            return False
        recorded = json.loads(_manifest_path(dest).read_text())
    except (OSError, ValueError):
        return False
    return (recorded == _listing(dest) and all(v[0] == "file" and v[1] == os.geteuid() for v in recorded.values())
            and same_files(src, dest) and verify(dest, group=False).ok)


def stage(src, to, *, progress: bool = True, say=print) -> dict:
    """Copy the model tree ``src`` to ``to/<its name>`` (node-local disk), unless a copy there already verifies.

    The copy goes to a temporary name beside the target and is renamed once complete, so a job that dies mid-copy
    never leaves a half tree under the real name; a stale or broken copy there is replaced.  Returns what it did:
    ``skipped``, ``bytes``, ``seconds`` and ``mb_per_s`` (10**6 bytes a second) of the copy.
    """
    from tqdm.auto import tqdm

    src = Path(src)
    to = private_folder(to, STAGE)
    dest = to / src.name
    if trusted_copy(src, dest):
        say(f"{dest} already holds this stage's verified copy of {src} (its manifest matches): not copied again")
        return {"src": str(src), "dest": str(dest), "skipped": True, "bytes": 0, "seconds": 0.0, "mb_per_s": None}
    source = verify(src, group=False)
    if not source.ok:
        raise WeightsError(f"{src} does not verify, so it is not staged: " + " ".join(source.problems))
    files = _files(src)
    total = sum(p.stat().st_size for p in files)
    where, free = _free_bytes(to)
    if free < total:
        raise WeightsError(f"{src} takes {total / 1e9:,.2f} GB and {where} has {free / 1e9:,.2f} GB free: stage to "
                           "another folder (LLMLAB_STAGE_DIR) or free space.")
    _remove_stale(to, src.name)
    tmp = Path(tempfile.mkdtemp(dir=to, prefix=f".{src.name}.staging-{os.getpid()}."))
    os.chmod(tmp, DIR_MODE)  # as the source tree: the group may read, nobody else may write
    started = time.monotonic()
    try:  # in a job's log (no terminal) the bar is a line every 30 s, not one every 0.1 s
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"staging {src.name}", disable=not progress,
                  mininterval=0.1 if sys.stderr.isatty() else 30) as bar:
            for p in files:
                target = tmp / p.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(p, "rb") as fin, open(target, "wb") as fout:
                    while chunk := fin.read(CHUNK):
                        fout.write(chunk)
                        bar.update(len(chunk))
                shutil.copymode(p, target)
        seconds = time.monotonic() - started
        _write_manifest(tmp)  # inodes and mtimes survive the rename: the manifest moves in with its copy
        if not _staged_by_another(src, dest, tmp):
            _put_in_place(src, tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    rate = total / 1e6 / seconds if seconds > 0 else None
    say(f"staged {src} -> {dest}: {total / 1e6:,.1f} MB in {seconds:.2f} s"
        + (f" ({rate:,.0f} MB/s)" if rate else ""))
    return {"src": str(src), "dest": str(dest), "skipped": False, "bytes": total, "seconds": seconds,
            "mb_per_s": rate}


def _put_in_place(src: Path, tmp: Path, dest: Path) -> None:
    """Rename the finished copy ``tmp`` to ``dest``.  Where a folder is there already, look again first: another
    node sharing the stage folder may have just renamed its verified copy there (keep it); else it is a stale or
    broken copy, moved out of the way and removed (a folder cannot replace a non-empty one)."""
    try:
        tmp.rename(dest)
        return
    except OSError:
        if _staged_by_another(src, dest, tmp):
            return
    old = dest.with_name(f".{src.name}.old-{os.getpid()}")
    dest.rename(old)
    shutil.rmtree(old)
    tmp.rename(dest)


def _staged_by_another(src: Path, dest: Path, tmp: Path) -> bool:
    """Did another job, or another node of this job where the stage folder is shared, put a verified copy at
    ``dest`` while this one copied?  Then it may be reading it: keep that one and drop this copy."""
    if trusted_copy(src, dest):
        shutil.rmtree(tmp)
        return True
    return False


def unstage(dest, *, say=print) -> dict:
    """Remove a copy that :func:`stage` made, and nothing else: a 141 GB copy stays on a node's own disk after the
    workshop otherwise, and an ``rm -rf`` typed on each node is one slip from the shared tree.  ``dest`` (the copy,
    ``LOCAL/NAME``) must be the caller's, with the stage's private manifest in it, and hold no file the manifest
    does not list (a copy damaged since is still the stage's; a file added is not).  What a killed stage left beside
    it goes too.  No copy there: nothing to do (a teardown runs it on every node)."""
    dest = Path(os.path.abspath(Path(dest).expanduser()))
    if not os.path.lexists(dest):
        say(f"{dest}: no staged copy here, nothing to remove")
        return {"dest": str(dest), "removed": False, "bytes": 0}
    if why := _not_staged(dest):
        raise WeightsError(f"{dest} {why}, so it is not a copy `llmlab weights stage` made and nothing is removed: "
                           f"give the copy's own folder (LOCAL/NAME){_copies_in(dest)}, or remove it yourself.")
    size = sum(p.stat().st_size for p in _files(dest))
    shutil.rmtree(dest)
    _remove_stale(dest.parent, dest.name)
    say(f"removed the staged copy {dest}: {size / 1e9:,.2f} GB freed")
    return {"dest": str(dest), "removed": True, "bytes": size}


def _not_staged(dest: Path) -> str | None:
    """Why ``dest`` is not a copy of the caller's stage (see :func:`unstage`), or None."""
    st = os.lstat(dest)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder (a file or a symbolic link)"
    if st.st_uid != os.geteuid():
        return f"belongs to {_owner(st.st_uid)}"
    try:
        mst = os.lstat(_manifest_path(dest))
        recorded = json.loads(_manifest_path(dest).read_text())
    except (OSError, ValueError):
        return f"holds no stage manifest ({MANIFEST})"
    if not stat.S_ISREG(mst.st_mode) or mst.st_uid != os.geteuid() or stat.S_IMODE(mst.st_mode) != 0o600:
        return f"holds a {MANIFEST} that is not your private (0600) file"
    added = sorted(set(_listing(dest)) - set(recorded))
    return f"holds files the stage did not copy ({_names(added)})" if added else None


def _copies_in(folder: Path) -> str:
    """The stage's copies inside ``folder`` (a stage folder given instead of a copy), for the sentence."""
    copies = sorted(str(p) for p in folder.iterdir() if (p / MANIFEST).is_file()) if folder.is_dir() else []
    return f"; it holds {_names(copies)}" if copies else ""


# --------------------------------------------------------------------------------------------------
# A dummy tree: a config's tensors at full size, for measuring staging without downloading a model
# --------------------------------------------------------------------------------------------------

SAFETENSORS_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def dummy_tree(model, root, *, shard_bytes: int = SHARD_BYTES, seed: int = 0) -> Path:
    """Write a model folder of ``model``'s tensors (``llmlab.memory.tensors``) in its checkpoint dtype, filled with
    pseudo-random bytes (not zeros: a file system may store zeros as holes, which read faster than weights), in
    shards of up to ``shard_bytes`` with an index, plus its config.json and the tiny model's tokenizer: a tree that
    :func:`verify` passes and vLLM's ``--load-format dummy`` never needs, sized like the real one for timing copies.
    Each shard is written as safetensors lays it out (8-byte header length, JSON header, data), a chunk at a time."""
    spec = memory.model_spec(model)
    if spec.quant_method is not None:
        raise WeightsError(f"{spec.name} is {spec.quant_method} quantized: a dummy tree is written for unquantized "
                           "models only (their tensors are llmlab.memory's list).")
    code, width = SAFETENSORS_CODES[spec.require_dtype()], memory.DTYPE_BITS[spec.require_dtype()] // 8
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    groups: list[list] = [[]]
    size = 0
    for t in memory.tensors(spec):
        if groups[-1] and size + t.numel * width > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.numel * width
    random_block = random.Random(seed).randbytes(CHUNK)
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        name = "model.safetensors" if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for t in group:
            header[t.name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + t.numel * width]}
            offset += t.numel * width
            weight_map[t.name] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes with spaces
        with open(root / name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            left = offset
            while left:
                block = random_block[: min(left, CHUNK)]
                f.write(block)
                left -= len(block)
        total += offset
    if len(groups) > 1:
        (root / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config, _ = memory.load_config(model if not isinstance(model, memory.ModelSpec) else spec.source)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    tiny = memory.MODELS_DIR / memory.TINY_NAME
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny / f, root / f)
    return root
