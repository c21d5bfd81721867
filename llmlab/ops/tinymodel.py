"""Build the course's tiny Llama from a registry-packaged corpus: ``python -m llmlab.ops.tinymodel``.

Why a model of our own: the notebooks must run on a laptop and in CI, where nothing may be downloaded
from a model hub.  So the project trains a real (if small) ``LlamaForCausalLM`` once, deterministically,
and ships it in ``llmlab/models/llmlab-tiny``.  Nobody needs to run this module to take the course; it
exists so that the shipped weights can be rebuilt and audited.

Corpus: the World English Bible (2015 revision, public domain) from Debian's ``sword-text-web``
package -- the cleanest modern English text that a package registry provides (see the model README).
The script needs ``apt-get download`` (Debian/Ubuntu) or ``--sword-dir`` pointing at an unpacked module.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import struct
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

from llmlab.serve.paths import DRAFT_MODEL, TINY_MODEL

MODEL_DIR = TINY_MODEL
SWORD_MODULE = "usr/share/sword/modules/texts/ztext/engWEB2015eb"

# The architecture: small enough to train in ~25 minutes on 2 CPU cores, with grouped-query attention
# (8 query heads share 2 KV heads) so that the KV-cache arithmetic of notebooks 01/02 is not trivial.
ARCH = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=640,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
# The draft model of notebook 12 (speculative decoding): the same tokenizer and text, a quarter of the work per
# token (2 layers, hidden 128; the head size stays 32), so that drafting 4 tokens costs less than one pass of the
# tiny model.  A drafter must share the target's vocabulary: its tokenizer is copied, not trained again.
DRAFT_ARCH = dict(ARCH, hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4)
DRAFT_DIR = DRAFT_MODEL
TRAIN = dict(seed=1234, steps=1400, batch=8, context=512, lr=3e-3, warmup=100, weight_decay=0.1,
             clip=1.0, val_fraction=0.02, threads=2)
SPECIALS = ["<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] | trim }}\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


# --------------------------------------------------------------------------------------------- corpus
def fetch_sword_module(workdir: Path) -> Path:
    """Download and unpack Debian's ``sword-text-web`` (no root needed) and return the module dir."""
    subprocess.run(["apt-get", "download", "sword-text-web"], cwd=workdir, check=True)
    deb = next(workdir.glob("sword-text-web_*.deb"))
    subprocess.run(["dpkg-deb", "-x", str(deb), str(workdir / "root")], check=True)
    return workdir / "root" / SWORD_MODULE


def read_ztext(module_dir: Path, testament: str) -> list[str]:
    """Return the raw OSIS text of every verse of one testament ("ot"/"nt") of a SWORD zText module.

    Format: ``.bzs`` holds 12-byte records (offset, size, uncompressed size) of zlib blocks in ``.bzz``;
    ``.bzv`` holds 10-byte records (block, offset, size) of each verse inside its decompressed block.
    """
    bzs = (module_dir / f"{testament}.bzs").read_bytes()
    bzz = (module_dir / f"{testament}.bzz").read_bytes()
    bzv = (module_dir / f"{testament}.bzv").read_bytes()
    blocks = []
    for i in range(0, len(bzs), 12):
        offset, size, _ = struct.unpack_from("<III", bzs, i)
        blocks.append(zlib.decompress(bzz[offset:offset + size]))
    verses = []
    for i in range(0, len(bzv), 10):
        block, offset, size = struct.unpack_from("<IIH", bzv, i)
        if size:
            verses.append(blocks[block][offset:offset + size].decode("utf-8"))
    return verses


_DROP = re.compile(r"<(note|title)\b[^>]*>.*?</\1>", re.S)
_PARAGRAPH = re.compile(r'<div[^>]*sID="[^"]*"[^>]*type="x-p"[^>]*/>|<chapter\b[^>]*sID=[^>]*/>')
_TAG = re.compile(r"<[^>]+>")


def paragraphs(osis_verses: list[str]) -> list[str]:
    """Turn OSIS verses into plain-text paragraphs (footnotes and headings dropped)."""
    text = " ".join(osis_verses)
    text = _DROP.sub("", text)
    text = _PARAGRAPH.sub("\n", text)
    text = _TAG.sub("", text)
    paras = [re.sub(r"\s+", " ", p).strip() for p in text.split("\n")]
    return [re.sub(r" ([,.;:?!])", r"\1", p) for p in paras if len(p) > 20]


def load_corpus(sword_dir: Path | None) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        module = sword_dir or fetch_sword_module(Path(tmp))
        return paragraphs(read_ztext(module, "ot")) + paragraphs(read_ztext(module, "nt"))


# ------------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(paras: list[str], out_dir: Path):
    """Byte-level BPE that adds BOS like Llama's tokenizer, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=ARCH["vocab_size"], special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(paras, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=ARCH["max_position_embeddings"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


# ------------------------------------------------------------------------------------------- training
def encode(fast, paras: list[str]):
    """One token stream: ``<s> paragraph </s>`` repeated, so the model learns to end a paragraph."""
    import torch

    ids = []
    for batch_start in range(0, len(paras), 1000):
        for row in fast(paras[batch_start:batch_start + 1000])["input_ids"]:
            ids.extend(row + [fast.eos_token_id])
    return torch.tensor(ids, dtype=torch.long)


def lr_at(step: int, recipe: dict | None = None) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak (``recipe``'s ``lr``, ``warmup`` and ``steps``; default
    the tiny model's :data:`TRAIN`)."""
    r = recipe or TRAIN
    if step < r["warmup"]:
        return r["lr"] * (step + 1) / r["warmup"]
    progress = (step - r["warmup"]) / max(1, r["steps"] - r["warmup"])
    return r["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batches(data, gen):
    import torch

    n, ctx = TRAIN["batch"], TRAIN["context"]
    starts = torch.randint(0, len(data) - ctx - 1, (n,), generator=gen)
    x = torch.stack([data[s:s + ctx] for s in starts])
    y = torch.stack([data[s + 1:s + ctx + 1] for s in starts])
    return x, y


def lm_loss(model, x, y):
    """Mean next-token cross-entropy; ``y`` is ``x`` shifted by one, so no shifting happens here."""
    import torch

    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def evaluate(model, data, n_batches: int = 20) -> float:
    import torch

    gen = torch.Generator().manual_seed(0)
    model.eval()
    with torch.no_grad():
        losses = [lm_loss(model, *batches(data, gen)) for _ in range(n_batches)]
    model.train()
    return float(sum(losses) / len(losses))


def train(out_dir: Path, sword_dir: Path | None, steps: int | None = None, arch: dict | None = None,
          tokenizer_from: Path | None = None) -> dict:
    """Train a model of ``arch`` (default: the tiny model's) on the corpus; with ``tokenizer_from``, reuse that
    model's tokenizer (a draft model must share its target's token ids) instead of training one."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if steps:
        TRAIN["steps"] = steps
    torch.manual_seed(TRAIN["seed"])
    torch.set_num_threads(TRAIN["threads"])
    t0 = time.time()
    paras = load_corpus(sword_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:  # the files as they are: the same ids, the same template
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy2(tokenizer_from / name, out_dir / name)
        fast = AutoTokenizer.from_pretrained(out_dir)
    else:
        fast = train_tokenizer(paras, out_dir)
    data = encode(fast, paras)
    n_val = int(len(data) * TRAIN["val_fraction"])
    train_data, val_data = data[:-n_val], data[-n_val:]
    print(f"corpus: {len(paras)} paragraphs, {sum(map(len, paras)) / 1e6:.1f} M characters, "
          f"{len(data) / 1e6:.2f} M tokens ({time.time() - t0:.0f} s)", flush=True)

    config = LlamaConfig(**(arch or ARCH), bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.pad_token_id)
    model = LlamaForCausalLM(config)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": TRAIN["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=TRAIN["lr"], betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(TRAIN["seed"])
    t_train = time.time()
    for step in range(TRAIN["steps"]):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x, y = batches(train_data, gen)
        loss = lm_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["clip"])
        opt.step()
        if step % 50 == 0 or step == TRAIN["steps"] - 1:
            rate = (step + 1) * TRAIN["batch"] * TRAIN["context"] / (time.time() - t_train)
            print(f"step {step:5d}  loss {loss.item():.3f}  lr {lr_at(step):.2e}  {rate:,.0f} tok/s", flush=True)
    train_minutes = (time.time() - t_train) / 60
    stats = {"train_loss": round(evaluate(model, train_data), 3), "val_loss": round(evaluate(model, val_data), 3),
             "train_minutes": round(train_minutes, 1),
             "tokens_seen": TRAIN["steps"] * TRAIN["batch"] * TRAIN["context"],
             "corpus_tokens": len(data), "parameters": sum(p.numel() for p in model.parameters()),
             "recipe": TRAIN}
    model.generation_config.pad_token_id = fast.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats, indent=2))
    return stats


def make_portable(out_dir: Path) -> None:
    """Let transformers 4.x (clusters' conda envs) read what transformers 5 wrote.

    transformers 5 names the tokenizer class ``TokenizersBackend`` and nests ``rope_theta`` under
    ``rope_parameters``; older releases know neither, so both spellings are written.
    """
    tok_path, cfg_path = out_dir / "tokenizer_config.json", out_dir / "config.json"
    tok = json.loads(tok_path.read_text())
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_path.write_text(json.dumps(tok, indent=2) + "\n")
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", ARCH["rope_theta"]))
    cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def samples(model_dir: Path, prompt: str = "In the beginning", max_new_tokens: int = 60) -> dict:
    """Greedy and T=0.8 continuations, for the model README."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok(prompt, return_tensors="pt").input_ids
    out = {}
    for temperature in (0.0, 0.8):
        torch.manual_seed(0)
        kwargs = {"do_sample": True, "temperature": temperature} if temperature else {"do_sample": False}
        gen = model.generate(ids, max_new_tokens=max_new_tokens, **kwargs)
        out[temperature] = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    return out


PURPOSE = {"llmlab-tiny": "so that the real vLLM engine has a\nreal model to serve on a laptop or in CI, with no "
                          "download.",
           "llmlab-tiny-draft": "as the draft model of notebook 12\n(speculative decoding): the tiny model's "
                                "tokenizer, trained on the same text, at a quarter of the\nwork per token."}
README = """# {name}

A {params:,}-parameter `LlamaForCausalLM` trained for the llmlab course, {purpose}
Not useful for anything but teaching.

- architecture: {layers} layers, hidden {hidden}, MLP {inter}, {heads} query heads sharing {kv} KV heads
  (grouped-query attention), context {ctx} tokens, tied input/output embeddings
- tokenizer: byte-level BPE with {vocab:,} tokens; adds `<s>`; paragraphs end with `</s>`, so the model
  stops by itself; a plain `Role: content` chat template in `chat_template.jinja`
- weights: float32 safetensors (serve with `--dtype float32` to match transformers exactly)
- corpus: the World English Bible, 2015 revision (public domain), from Debian's `sword-text-web`
  package: {paras:,} paragraphs, {corpus_tokens:,} tokens, the last 2 % held out
- training: `{command}` (seed {seed}): {steps} steps of {batch} x {context} tokens
  ({tokens_seen:,} tokens, {epochs:.1f} epochs), AdamW, peak lr {lr} with warm-up and cosine decay
- time: {minutes} minutes on 2 CPU cores
- final loss (cross-entropy, nats per token): train {train_loss}, held-out {val_loss}

Why this corpus: it is the largest clean, modern, freely licensed English text that a package registry
ships (Debian `sword-text-web`); no registry package bundles a neutral narrative corpus of that size.
Expect Bible-flavoured English with correct spelling and punctuation but no lasting meaning.

## Samples (prompt "In the beginning", 60 new tokens, transformers)

Temperature 0 (greedy; note how it loops):

> {greedy}

Temperature 0.8 (seed 0):

> {warm}
"""


def write_readme(out_dir: Path, paras: int, sample: dict) -> None:
    stats = json.loads((out_dir / "training.json").read_text())
    config = json.loads((out_dir / "config.json").read_text())
    recipe = stats["recipe"]
    text = README.format(
        name=out_dir.name, purpose=PURPOSE.get(out_dir.name, ""),
        command="python -m llmlab.ops.tinymodel" + (" --draft" if out_dir.name == DRAFT_DIR.name else ""),
        params=stats["parameters"], layers=config["num_hidden_layers"], hidden=config["hidden_size"],
        inter=config["intermediate_size"], heads=config["num_attention_heads"], kv=config["num_key_value_heads"],
        ctx=config["max_position_embeddings"], vocab=config["vocab_size"], paras=paras,
        corpus_tokens=stats["corpus_tokens"], seed=recipe["seed"], steps=recipe["steps"], batch=recipe["batch"],
        context=recipe["context"], tokens_seen=stats["tokens_seen"], lr=recipe["lr"],
        epochs=stats["tokens_seen"] / stats["corpus_tokens"], minutes=stats["train_minutes"],
        train_loss=stats["train_loss"], val_loss=stats["val_loss"],
        greedy=sample[0.0].strip().replace("\n", " "), warm=sample[0.8].strip().replace("\n", " "))
    (out_dir / "README.md").write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=MODEL_DIR)
    parser.add_argument("--sword-dir", type=Path, help="an unpacked engWEB2015eb module (default: apt-get download)")
    parser.add_argument("--steps", type=int, help=f"training steps (default {TRAIN['steps']})")
    parser.add_argument("--draft", action="store_true", help=f"train notebook 12's draft model into {DRAFT_DIR.name}")
    args = parser.parse_args(argv)
    if args.draft and args.out == MODEL_DIR:
        args.out = DRAFT_DIR
    tmp_out = Path(tempfile.mkdtemp(prefix="llmlab-tiny-"))
    train(tmp_out, args.sword_dir, args.steps, arch=DRAFT_ARCH if args.draft else None,
          tokenizer_from=MODEL_DIR if args.draft else None)
    for name in ("training.json", "config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tmp_out / name).exists():
            args.out.mkdir(parents=True, exist_ok=True)
            shutil.copy2(tmp_out / name, args.out / name)
    make_portable(args.out)
    sample = samples(args.out)
    write_readme(args.out, len(load_corpus(args.sword_dir)), sample)
    for t, text in sample.items():
        print(f"--- temperature {t}:\n{text}")


if __name__ == "__main__":
    main()
