"""Cluster mode: the notebooks against a server that is not the tiny model, found the way a cluster's is.

Why: "the same notebooks run unchanged everywhere" can only fail where the server differs.  In CI every notebook
otherwise talks to the embedded tiny model, so a lesson cell that asserts a fact of the tiny model (its 512-token
context, its 128-token CPU blocks, its tokenizer) passes there and raises in front of a workshop room.  Here a
second small Llama, ``llmlab-wide``, differs from the tiny model in every shape a lesson might assume:

=====================  ===============  ===============
                       llmlab-tiny      llmlab-wide
=====================  ===============  ===============
context                512              2,048
vocabulary             4,096            1,024 (its own BPE)
heads / KV heads       8 / 2            6 / 3
layers, hidden         4, 256           3, 192
KV block (vLLM-CPU)    128 tokens       32 tokens
embeddings             tied             untied
weights                trained          random
=====================  ===============  ===============

It is served by the launcher's own CPU job (``slurm/llmlab-wide-cpu.sh``: sbatch, Ray over two nodes, vLLM-CPU,
the key-checking proxy) under the SLURM test bed, and the notebooks find it through the connection file the
job writes, exactly as on a cluster.  Its config and tokenizer are committed in ``tests/fixtures/llmlab-wide``;
the random weights are written at run time (a few MB, seeded).  ``make test-cluster`` runs it.

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
FIXTURE = ROOT / "tests" / "fixtures" / "llmlab-wide"
JOB = "llmlab-wide-cpu"
ARCH = dict(vocab_size=1024, hidden_size=192, intermediate_size=512, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=3, head_dim=32, max_position_embeddings=2048, rope_theta=500000.0,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2, torch_dtype="float32")


def build_fixture(out: Path = FIXTURE) -> None:
    """The config and a 1,024-token byte-level BPE trained on the course's own notebook text (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    sys.path.insert(0, str(ROOT))
    from llmlab.ops.tinymodel import CHAT_TEMPLATE, SPECIALS

    texts = []
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        texts += ["".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "markdown"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=ARCH["vocab_size"], special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=ARCH["max_position_embeddings"])
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    LlamaConfig(**ARCH, architectures=["LlamaForCausalLM"]).save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())  # transformers 4.x readers want these spellings too
    cfg.setdefault("rope_theta", ARCH["rope_theta"])
    cfg["torch_dtype"] = ARCH["torch_dtype"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")


def build_weights(out: Path) -> Path:
    """The fixture plus seeded random weights in ``out`` (skipped when already there)."""
    import shutil

    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(FIXTURE))
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(FIXTURE, tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    shutil.copy(FIXTURE / "config.json", tmp / "config.json")  # keep the committed config, not a re-serialised one
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
