"""Train lesson 17's LoRA adapters of the tiny model: ``python -m llmlab.ops.tinylora``.

Why adapters of our own: lesson 17 serves several fine-tunes of one base model from one engine, and nothing may be
downloaded from a hub.  The tiny model learnt modern English from the World English Bible (Debian's
``sword-text-web``); Debian ships the same book in two more voices, so each adapter teaches it one:

- ``kjv``: the King James Version (1769 text, public domain; ``sword-text-kjv``): "thou", "hath", "unto";
- ``rv1909``: the Reina-Valera of 1909 (Spanish, public domain; ``sword-text-sparv``), through the base model's
  English tokenizer, which an adapter cannot change.

The layer is written out (no peft): each adapted matrix ``W`` gains ``A`` (rank x in, small random) and ``B``
(out x rank, zeros, so training starts from the base model exactly), and computes ``W x + (alpha / rank) B A x``;
only ``A`` and ``B`` learn.  They are saved in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``), which vLLM's ``--lora-modules`` reads.  Nobody needs to run this to take the
course: it exists so that the shipped adapters can be rebuilt and audited.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from llmlab.memory.lora import ALL_LINEAR
from llmlab.ops import tinymodel as tm
from llmlab.serve.paths import TINY_MODEL

ADAPTERS_DIR = TINY_MODEL.parent / "adapters"
# name: (Debian package, SWORD module, what the adapter teaches)
CORPORA = {"kjv": ("sword-text-kjv", "engKJV2006eb", "the King James Version's English of 1769"),
           "rv1909": ("sword-text-sparv", "spaRV1909eb", "the Spanish of the Reina-Valera of 1909")}
LORA = dict(rank=8, alpha=16, targets=list(ALL_LINEAR))
# batches of the tiny model's own recipe (8 x 512 tokens, tinymodel.batches)
TRAIN = dict(seed=4321, steps=400, lr=3e-3, warmup=20, val_fraction=0.02, threads=2)


def fetch_module(package: str, module: str, workdir: Path) -> Path:
    """``apt-get download`` one SWORD package (no root needed) and return its module directory."""
    subprocess.run(["apt-get", "download", package], cwd=workdir, check=True)
    deb = next(workdir.glob(f"{package}_*.deb"))
    subprocess.run(["dpkg-deb", "-x", str(deb), str(workdir / "root")], check=True)
    return workdir / "root" / "usr/share/sword/modules/texts/ztext" / module.lower()


def load_corpus(name: str, sword_dir: Path | None = None) -> list[str]:
    """The paragraphs of one adapter's text, with the KJV's paragraph marks (pilcrows) dropped."""
    package, module, _ = CORPORA[name]
    with tempfile.TemporaryDirectory() as tmp:
        found = sword_dir or fetch_module(package, module, Path(tmp))
        if not found.is_dir():  # the module folder's case differs between packages
            found = next(p for p in found.parent.iterdir() if p.name.lower() == module.lower())
        paras = tm.paragraphs(tm.read_ztext(found, "ot")) + tm.paragraphs(tm.read_ztext(found, "nt"))
    return [p.lstrip("¶ ").strip() for p in paras]


def adapted(linear, rank: int, alpha: int, gen):
    """``linear`` with an adapter beside it: ``W x + (alpha / rank) B A x``, with ``A`` small and random and ``B``
    zeros, so that training starts from the base model exactly."""
    import torch

    class Adapted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base, self.scale = linear, alpha / rank
            self.lora_A = torch.nn.Parameter(torch.randn(rank, linear.in_features, generator=gen)
                                             / math.sqrt(linear.in_features))
            self.lora_B = torch.nn.Parameter(torch.zeros(linear.out_features, rank))

        def forward(self, x):
            return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scale

    return Adapted()


def add_adapters(model, gen) -> dict:
    """Freeze ``model`` and put an adapted layer in place of every target linear; returns ``{peft key: layer}``."""
    for p in model.parameters():
        p.requires_grad_(False)
    layers = {}
    for i, block in enumerate(model.model.layers):
        for part in (block.self_attn, block.mlp):
            for name in LORA["targets"]:
                if hasattr(part, name):
                    layer = adapted(getattr(part, name), LORA["rank"], LORA["alpha"], gen)
                    setattr(part, name, layer)
                    kind = "self_attn" if part is block.self_attn else "mlp"
                    layers[f"base_model.model.model.layers.{i}.{kind}.{name}"] = layer
    return layers


def save_adapter(layers: dict, out_dir: Path) -> None:
    """PEFT's two files: what vLLM's ``--lora-modules NAME=DIR`` loads."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, layer in layers.items():
        tensors[f"{key}.lora_A.weight"] = layer.lora_A.detach().contiguous()
        tensors[f"{key}.lora_B.weight"] = layer.lora_B.detach().contiguous()
    save_file(tensors, out_dir / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "llmlab-tiny",
              "r": LORA["rank"], "lora_alpha": LORA["alpha"], "target_modules": LORA["targets"],
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
              "use_rslora": False, "use_dora": False}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def train(name: str, out_dir: Path, sword_dir: Path | None = None, steps: int | None = None) -> dict:
    """Train adapter ``name`` on its corpus from the shipped tiny model; the held-out loss of the base model and
    of the adapted one go into ``training.json``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = dict(TRAIN, steps=steps or TRAIN["steps"], batch=tm.TRAIN["batch"], context=tm.TRAIN["context"])
    torch.manual_seed(recipe["seed"])
    torch.set_num_threads(recipe["threads"])
    paras = load_corpus(name, sword_dir)
    fast = AutoTokenizer.from_pretrained(TINY_MODEL)
    data = tm.encode(fast, paras)
    n_val = int(len(data) * recipe["val_fraction"])
    train_data, val_data = data[:-n_val], data[-n_val:]
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    base_val = tm.evaluate(model, val_data)
    gen = torch.Generator().manual_seed(recipe["seed"])
    layers = add_adapters(model, gen)
    params = [p for layer in layers.values() for p in (layer.lora_A, layer.lora_B)]
    opt = torch.optim.AdamW(params, lr=recipe["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    print(f"{name}: {len(paras)} paragraphs, {len(data):,} tokens; {sum(p.numel() for p in params):,} adapter "
          f"parameters; base model's held-out loss {base_val:.3f}", flush=True)
    t0 = time.time()
    for step in range(recipe["steps"]):
        for group in opt.param_groups:
            group["lr"] = tm.lr_at(step, recipe)
        loss = tm.lm_loss(model, *tm.batches(train_data, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 20 == 0 or step == recipe["steps"] - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  {time.time() - t0:.0f} s", flush=True)
    stats = {"adapter": name, "teaches": CORPORA[name][2], "debian_package": CORPORA[name][0],
             "paragraphs": len(paras), "corpus_tokens": len(data), "parameters": sum(p.numel() for p in params),
             "base_val_loss": round(base_val, 3), "val_loss": round(tm.evaluate(model, val_data), 3),
             "train_minutes": round((time.time() - t0) / 60, 1), "lora": LORA, "recipe": recipe}
    save_adapter(layers, out_dir)
    (out_dir / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats, indent=2), flush=True)
    return stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", default=list(CORPORA), help=f"adapters to train ({', '.join(CORPORA)})")
    parser.add_argument("--out", type=Path, default=ADAPTERS_DIR, help="the folder that gets one folder per adapter")
    parser.add_argument("--steps", type=int, help=f"training steps (default {TRAIN['steps']})")
    args = parser.parse_args(argv)
    for name in args.names:
        if name not in CORPORA:
            parser.error(f"no adapter {name!r}: choose from {', '.join(CORPORA)}")
        with tempfile.TemporaryDirectory(prefix=f"llmlab-lora-{name}-") as tmp:
            train(name, Path(tmp), steps=args.steps)
            shutil.rmtree(args.out / name, ignore_errors=True)
            shutil.copytree(tmp, args.out / name)
        (args.out / name).chmod(0o755)  # mkdtemp's 0700 and 0600 would follow the files into the package
        for f in (args.out / name).iterdir():
            f.chmod(0o644)


if __name__ == "__main__":
    main()
