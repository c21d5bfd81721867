"""Prefill and decode on two engines of the CPU build, the KV cache moved between them: the facts lesson 18 starts
from (issue 40).

vLLM's ``ExampleConnector`` (``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``) is the simplest
KV connector: an engine started as ``kv_producer`` writes each prompt's KV cache, layer by layer, as safetensors files
in a shared folder; one started as ``kv_consumer`` loads them instead of computing the prompt.  It is plain torch, so
it runs on the CPU build.  This script starts a producer (the "prefill" engine), sends prompts with
``max_tokens=1``, stops it, then starts a consumer (the "decode" engine) on the same folder and sends the same
prompts for ``--max-tokens``.  It prints, per prompt: the bytes the producer wrote against
``llmlab.memory.kv_bytes_per_token`` times the whole blocks of the prompt, the tokens the consumer reports as
cached (loaded, not computed), and whether its greedy answer equals the producer's own.

    .venv/bin/python benchmarks/pd_connector_on_cpu.py
"""

import argparse
import shutil
import tempfile
from pathlib import Path

import llmlab
from llmlab import disagg, engines, memory

PROMPTS = ["In the beginning God created the heavens and the earth. " * 12,
           "And the king said to his servants, go and bring me the scroll that is in the house. " * 9]


def ask(srv, max_tokens: int) -> list:
    client, model = llmlab.connect(srv.base_url, srv.api_key, quiet=True)
    return [client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0) for p in PROMPTS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="llmlab-kv-"))
    with engines.start(disagg.connector_args("kv_producer", folder), progress=False) as producer:
        ask(producer, 1)                       # the prefill: the KV cache is written to the folder
        reference = ask(producer, args.max_tokens)  # the producer's own greedy answers, to compare with
    with engines.start(disagg.connector_args("kv_consumer", folder), progress=False) as consumer:
        decoded = ask(consumer, args.max_tokens)
        client, _ = llmlab.connect(consumer.base_url, consumer.api_key, quiet=True)
        sources = disagg.by_source(client)  # vllm:prompt_tokens_by_source, the consumer's own count
    per_token, block = memory.kv_bytes_per_token("llmlab-tiny", dtype="float32"), memory.CPU_BLOCK_SIZE
    for ref, got in zip(reference, decoded, strict=True):
        n = got.usage.prompt_tokens
        whole = n // block * block
        print(f"prompt of {n} tokens: {whole} in whole blocks of {block}, {whole * per_token:,} bytes of KV "
              f"({per_token:,} per token); the consumer loaded {got.usage.prompt_tokens_details.cached_tokens} "
              f"and computed {n - got.usage.prompt_tokens_details.cached_tokens}; same greedy answer as the "
              f"producer: {got.choices[0].text == ref.choices[0].text}")
    print(f"the consumer's prompt tokens by source (vllm:prompt_tokens_by_source): {sources}")
    for d in sorted(folder.iterdir()):
        files = sorted(d.iterdir())
        print(f"{d.name}: {len(files)} files (a layer each), {sum(f.stat().st_size for f in files):,} bytes with "
              f"their safetensors headers; {files[0].name}: {files[0].stat().st_size:,}")
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
