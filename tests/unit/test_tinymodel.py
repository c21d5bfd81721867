"""The shipped tiny model: a real Llama that transformers and vLLM both load, and that learned English.

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/engine/test_tinymodel.py (the tests that start the real engine).
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmlab.ops import tinymodel
from llmlab.serve.paths import TINY_MODEL


@pytest.fixture(scope="module")
def hf():
    return AutoTokenizer.from_pretrained(TINY_MODEL), AutoModelForCausalLM.from_pretrained(TINY_MODEL).eval()


def test_it_is_a_small_llama_with_grouped_query_attention():
    config = json.loads((TINY_MODEL / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    size = sum(p.stat().st_size for p in TINY_MODEL.iterdir())
    assert size <= 25 * 2**20, f"the shipped model is {size / 2**20:.1f} MiB"


def test_tokenizer_adds_bos_and_has_a_chat_template(hf):
    tok, _ = hf
    ids = tok("In the beginning").input_ids
    assert ids[0] == tok.bos_token_id and tok.eos_token_id is not None
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<s>User: Hello\nAssistant:"


def test_model_learned_word_order(hf):
    """Real English must cost far less than the same words shuffled: the model learned the language."""
    tok, model = hf
    sentences = ["Then the king said to his servants, “Go and bring the man to me.”",
                 "And it happened in those days that the people went out of the city.",
                 "I will give you a land flowing with milk and honey."]
    shuffled = [" ".join(sorted(s.split(), key=lambda w: (len(w), w))) for s in sentences]

    def loss(texts):
        with torch.no_grad():
            return sum(model(**(b := tok(t, return_tensors="pt")), labels=b.input_ids).loss.item() for t in texts)

    assert loss(sentences) / len(sentences) < 4.0
    assert loss(sentences) < 0.6 * loss(shuffled)


def test_model_ends_paragraphs_with_eos(hf):
    """It was trained on `<s> paragraph </s>`, so greedy text ends by itself: finish_reason "stop" is real."""
    tok, model = hf
    ids = tok("Jesus wept", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=200, do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    assert new[-1] == tok.eos_token_id and 10 < len(new) < 200  # a sentence or two, then the end


OSIS = ('<div sID="g1" type="x-p"/><chapter n="1" osisID="Gen.1" sID="Gen.1"/><title type="main">Creation</title>'
        '<w lemma="H1">In</w> <w>the</w> <w>beginning</w>, God created the heavens and the earth.'
        '<note placement="foot">Or, a footnote that must go</note>')


def test_corpus_extraction_drops_notes_titles_and_tags():
    paras = tinymodel.paragraphs([OSIS, "Now the earth was formless and empty ."])
    assert paras == ["In the beginning, God created the heavens and the earth. Now the earth was formless and empty."]


def test_training_record_is_shipped():
    record = json.loads((TINY_MODEL / "training.json").read_text())
    assert record["recipe"]["seed"] == tinymodel.TRAIN["seed"]
    assert record["val_loss"] < 5.0 and record["train_minutes"] > 0
