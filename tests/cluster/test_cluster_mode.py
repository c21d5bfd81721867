"""Cluster mode (``make test-cluster``): the server the notebooks find is the launcher's job, and it is not the tiny
model in any shape a lesson could assume -- so a tiny-model-only assert in a lesson fails here.

These tests need the job that ``LLMLAB_TEST_SERVER=cluster`` starts (``llmlab.ops.testing``, ``tests/cluster_mode.py``);
``make test`` deselects them with the ``cluster`` marker.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import llmlab
from llmlab import kvcache, memory, offline
from llmlab.serve.info import ServerInfo

pytestmark = pytest.mark.cluster

TINY = memory.model_spec(memory.TINY_NAME)


@pytest.fixture(scope="module")
def server():
    path = os.environ.get("LLMLAB_CONNECTION_FILE")
    assert os.environ.get("LLMLAB_TEST_SERVER") == "cluster" and path, \
        "run these with `make test-cluster` (LLMLAB_TEST_SERVER=cluster starts the job)"
    return ServerInfo.read(path)


def test_connect_finds_the_launchers_job_through_its_connection_file(server):
    client, model = llmlab.connect(quiet=True)
    assert server.kind == "slurm" and server.job_id and model == "llmlab-wide-cpu" == server.model
    assert str(client.base_url).rstrip("/") == server.base_url
    r = client.completions.create(model=model, prompt="A cluster", max_tokens=4, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4


def test_every_shape_a_lesson_might_assume_differs_from_the_tiny_model(server):
    client, model = llmlab.connect(quiet=True)
    card = client.models.list().data[0]
    assert card.max_model_len == 2048 != TINY.max_position_embeddings
    info = kvcache.fetch_metrics(server.base_url, server.key()).labels(kvcache.CACHE_CONFIG)
    assert int(info["block_size"]) == 32 != memory.CPU_BLOCK_SIZE
    wide = memory.model_spec(Path(__file__).parents[1] / "fixtures" / "llmlab-wide")
    for field in ("vocab_size", "num_kv_heads", "num_layers", "hidden_size", "intermediate_size",
                  "tie_word_embeddings"):
        assert getattr(wide, field) != getattr(TINY, field), field
    assert memory.kv_bytes_per_token(wide) != memory.kv_bytes_per_token(TINY)
    text = "In the beginning God created"
    tiny_ids = offline.load_tokenizer()(text)["input_ids"]
    served_ids = kvcache.server_token_ids(client, model, text)
    assert len(served_ids) == len(tiny_ids) and served_ids != tiny_ids  # the same pieces under other ids


def test_the_wide_model_is_the_tiny_one_reshaped():
    """Same function, other shapes: the lessons that show what a trained model does still hold (see
    tests/cluster_mode.py), and nothing else of the tiny model does."""
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(Path(__file__).parents[1]))
    import cluster_mode

    tiny = load_file(cluster_mode.TINY / "model.safetensors")
    wide = cluster_mode.wide_weights(tiny, TINY.head_dim)
    assert wide["model.embed_tokens.weight"].shape == (4160, 320) and len({k for k in wide if "layers.4." in k}) == 9
    from transformers import LlamaConfig, LlamaForCausalLM

    models = [LlamaForCausalLM.from_pretrained(cluster_mode.TINY, dtype=torch.float32).eval(),
              LlamaForCausalLM(LlamaConfig.from_pretrained(cluster_mode.FIXTURE)).eval()]
    models[1].load_state_dict(wide)
    ids = torch.tensor([[0, 5, 17, 300, 2000, 4000]])
    perm = torch.tensor(cluster_mode._permutation(4096))
    with torch.no_grad():
        a, b = models[0](ids).logits[0], models[1](perm[ids]).logits[0]
    assert torch.allclose(a, b[:, perm], atol=1e-4)
    assert b.softmax(-1)[:, 4096:].sum(-1).max() < 1e-3  # the unused ids are (almost) never drawn


def test_a_lesson_cell_that_asserts_the_tiny_models_context_fails_here(tmp_path):
    """The reason for cluster mode: the same cell passes against the embedded tiny model and fails here."""
    cells = ["import llmlab\nclient, model = llmlab.connect()",
             "card = client.models.list().data[0]\nassert card.max_model_len == 512  # the tiny model's context"]
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                     "source": textwrap.dedent(c)} for c in cells],
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "tiny_only.ipynb"
    path.write_text(json.dumps(nb))
    # Without the project's configuration (-c /dev/null: no llmlab plugin), so the kernel sees this session's
    # LLMLAB_HOME and LLMLAB_CONNECTION_FILE unchanged and connect() finds the job, as a learner's kernel would.
    result = subprocess.run([sys.executable, "-m", "pytest", "-c", os.devnull, "--rootdir", str(tmp_path),
                             "--nbval-lax", "--nbval-current-env", "-q", "-p", "no:cacheprovider", str(path)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 1, result.stdout[-2000:]
    assert "AssertionError" in result.stdout and "1 failed, 1 passed" in result.stdout, result.stdout[-2000:]
