"""Speculative decoding (notebook 12, ``llmlab.speculative``): flags refused before vLLM sees them, the textbook
formula, the counters' arithmetic, the shipped draft model's vocabulary, and a plain engine taking one pass per
token.

The drafting engines themselves are asserted by notebook 12's cells, which ``make test`` runs under nbval in the
same session: the same greedy text and logprobs (within 1e-4) as the plain engine, drafts of k tokens, a loop
drafted whole (acceptance > 0.9, more than 3 tokens per pass), acceptance that falls with the position, and the
draft model's engine giving the plain engine's text with drafts of k tokens.  A second
drafting engine here only started the same engine again (56 s of CI's `make test`, issue 23).

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/engine/test_speculative.py (the tests that start the real engine).
"""

import json
from pathlib import Path

import pytest

from llmlab import speculative
from llmlab.serve.metrics import Counters
from llmlab.serve.paths import TINY_MODEL


def test_ngram_flags_and_the_mistakes_refused_before_vllm_sees_them():
    flag, config = speculative.ngram_args(k=3, lookup_min=1, lookup_max=5)
    assert flag == "--speculative-config"
    assert json.loads(config) == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 5}
    for kwargs, message in (({"k": 0}, "k=0: give a whole number"), ({"k": 2.5}, "k=2.5"),
                            ({"k": True}, "k=True"),
                            ({"lookup_min": 5, "lookup_max": 2}, "lookup_min=5 > lookup_max=2"),
                            ({"k": 40}, "vLLM's examples use 2 to 8")):
        with pytest.raises(ValueError, match=message):
            speculative.ngram_args(**kwargs)


def test_draft_model_flags_name_the_shipped_draft_and_refuse_a_folder_without_a_model(tmp_path):
    flag, config = speculative.draft_args(k=3)
    assert flag == "--speculative-config"
    assert json.loads(config) == {"method": "draft_model", "model": str(speculative.DRAFT_MODEL),
                                  "num_speculative_tokens": 3}
    draft = json.loads((speculative.DRAFT_MODEL / "config.json").read_text())
    tiny = json.loads((TINY_MODEL / "config.json").read_text())
    assert draft["vocab_size"] == tiny["vocab_size"]  # the same token ids, or its guesses mean other words
    assert (speculative.DRAFT_MODEL / "tokenizer.json").read_text() == (TINY_MODEL / "tokenizer.json").read_text()
    assert draft["num_hidden_layers"] * draft["hidden_size"] < tiny["num_hidden_layers"] * tiny["hidden_size"]
    with pytest.raises(FileNotFoundError, match="no config.json there"):
        speculative.draft_args(model=tmp_path)
    with pytest.raises(ValueError, match="k=0: give a whole number"):
        speculative.draft_args(k=0)


def test_expected_tokens_per_step_is_the_geometric_sum():
    assert speculative.expected_tokens_per_step(0.0, 4) == 1.0  # nothing accepted: the model's own token only
    assert speculative.expected_tokens_per_step(1.0, 4) == 5.0  # all accepted: k + 1
    assert speculative.expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    assert speculative.expected_tokens_per_step(0.6, 4) == pytest.approx(sum(0.6 ** i for i in range(5)))
    for alpha, k, message in ((1.2, 4, "between 0 and 1"), (0.5, -1, "whole number"), (0.5, 2.0, "whole number")):
        with pytest.raises(ValueError, match=message):
            speculative.expected_tokens_per_step(alpha, k)


def test_a_difference_without_output_tokens_is_refused():
    snap = Counters(drafts=3, draft_tokens=12, accepted=5, generated=40, accepted_at=(2, 1, 1, 1))
    with pytest.raises(ValueError, match="no output tokens between these scrapes"):
        speculative.speculation(snap - snap)
    later = Counters(drafts=5, draft_tokens=20, accepted=11, generated=60, accepted_at=(4, 3, 2, 2))
    d = speculative.speculation(later - snap)
    assert (d.acceptance_rate, d.mean_accepted, d.tokens_per_step) == (6 / 8, 3.0, 20 / 14)
    assert d.accepted_at == [1.0, 1.0, 0.5, 0.5]
    table = speculative.position_table(d)
    assert list(table["if independent"]) == [1.0] * 4  # position 0's share, 1.0 here, to the power p + 1
    assert list(table["given the one before"]) == [1.0, 1.0, 0.5, 1.0]
    first = Counters(drafts=2, draft_tokens=8, accepted=3, generated=20)  # a server's first scrape: no positions yet
    assert speculative.speculation(later - first).accepted_at == [4 / 3, 1.0, 2 / 3, 2 / 3]


def test_tokens_per_drafting_step_are_one_plus_r_k_and_the_formula_needs_the_conditional_alpha():
    """vLLM's rate r (accepted / drafted) makes 1 + r * k exactly; fed to Leviathan's formula it always falls
    short, even when every token is accepted independently (alpha = 0.6, k = 4: r = 0.33, formula 1.48, truth
    2.31).  The per-position shares give alpha back, and independence as s_p = s_0 ** (p + 1)."""
    alpha, k, drafts = 0.6, 4, 1000.0
    shares = [alpha ** (p + 1) for p in range(k)]  # independent: accepted up to p with probability alpha^(p+1)
    accepted = drafts * sum(shares)
    d = speculative.speculation(Counters(drafts=drafts, draft_tokens=drafts * k, accepted=accepted, generated=5000,
                                         accepted_at=tuple(drafts * s for s in shares)) - Counters())
    r = d.acceptance_rate
    assert r == pytest.approx(0.3264) and 1 + r * k == pytest.approx(1 + d.mean_accepted)
    assert 1 + d.mean_accepted == pytest.approx(speculative.expected_tokens_per_step(alpha, k))  # 2.31
    assert speculative.expected_tokens_per_step(r, k) == pytest.approx(1.48, abs=0.01)  # r is not alpha
    assert speculative.conditional_acceptance(d) == pytest.approx([alpha] * k)
    table = speculative.position_table(d)
    assert list(table["if independent"]) == list(table["accepted up to here"])


def test_lesson_12s_cluster_line_reaches_vllms_argument_parser_intact():
    """The line notebook 12 gives for a cluster, as bash hands it to the launcher, rendered into the job's
    ``vllm serve`` flags and parsed by vLLM's own argument parser: the same config the lesson's engine ran."""
    import re
    import shlex

    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from llmlab.ops import launcher

    nb = json.loads((Path(__file__).resolve().parents[2] / "notebooks" / "12_speculative_decoding.ipynb").read_text())
    source = "".join(line for cell in nb["cells"] for line in cell["source"])
    line = re.search(r"`(LLMLAB_EXTRA_VLLM_ARGS='[^']+')`", source)[1]
    name, _, value = shlex.split(line)[0].partition("=")  # what bash puts in the environment
    job = launcher.render("llmlab-tiny-cpu", env={name: value})
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", job.model_path, *job.flags])
    assert args.speculative_config == json.loads(speculative.ngram_args(k=4, lookup_min=2, lookup_max=4)[1])
