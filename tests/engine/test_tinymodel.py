"""The shipped tiny model: a real Llama that transformers and vLLM both load, and that learned English.

This file holds the tests that start the real engine (or need root); the rest are in tests/unit/test_tinymodel.py
(the pure tests).
"""


import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmlab.serve.paths import TINY_MODEL


@pytest.fixture(scope="module")
def hf():
    return AutoTokenizer.from_pretrained(TINY_MODEL), AutoModelForCausalLM.from_pretrained(TINY_MODEL).eval()


def test_vllm_greedy_matches_transformers(embedded, hf):
    """The same weights in two engines: same tokens, same first-token log-probability (fp32 both)."""
    import llmlab

    tok, model = hf
    client, name = llmlab.connect(quiet=True)
    for prompt in ["In the beginning", "The Lord is my shepherd", "And he said to them,"]:
        ids = tok(prompt, return_tensors="pt").input_ids
        ref = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
        ref_text = tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
        got = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0, logprobs=1)
        assert got.choices[0].text == ref_text
        with torch.no_grad():
            first = model(ids).logits[0, -1].log_softmax(-1).max().item()
        assert got.choices[0].logprobs.token_logprobs[0] == pytest.approx(first, abs=1e-3)
