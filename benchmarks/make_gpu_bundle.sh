#!/usr/bin/env bash
# Build the pieces that benchmarks/rehearse_on_device.sh unpacks on a lent GPU machine: vLLM's CUDA build and the
# packages that machine lacks, slimmed to what serves a dense Llama on Hopper, as one tar.xz cut into pieces.
#
#   sed -n 's/^.*Packages: //p' /work/.library/device/KINDS.md >/tmp/device-packages   # the machine's packages
#   DEVICE_PACKAGES=/tmp/device-packages PY=python3.12 benchmarks/make_gpu_bundle.sh  # .whl/site.tar.xz.00, .01
#   RAY=2.60.0 DEVICE_PACKAGES=... benchmarks/make_gpu_bundle.sh   # the set, then Ray: .whl/bundle.NN (BUNDLE=)
#
# .whl/ must be ignored (echo /.whl/ >>.git/info/exclude).  PY: a Python 3.12 with pip (the machine's version).
#
# Why each step (shared/notes/vllm-gpu.md has the measurements):
# - vLLM 0.26.0 is the newest release that pins the machine's torch 2.11.0 (+cu130).
# - pip resolves vLLM's whole dependency tree from the registry's metadata without downloading it (--dry-run
#   --report); the machine's own packages (DEVICE_PACKAGES, the list in the device tool's KINDS.md) are left out.
# - Left out too, because a dense Llama on Hopper never loads them: FlashInfer, TileLang, the CUTLASS DSL and its
#   kernels, the video codecs, fastsafetensors, cuDNN's frontend, the MLA and MoE kernels, FA2 (Hopper uses FA3),
#   the Rust front end, Blackwell's FMHA headers, DeepGEMM for other Pythons, Mistral's tokenizer data.
#   Without FlashInfer the server needs VLLM_USE_FLASHINFER_SAMPLER=0 (llmlab.ops.rehearsal sets it).
# - apache-tvm-ffi 0.1.15.post2 replaces vLLM's pin 0.1.10, which breaks xgrammar's import.
# - Each piece plus the repository must stay under the 64 MiB a call carries: 46.9 MB pieces fitted beside the
#   19 MB repository of 2026-11-22; beside its 24.7 MB of 2026-11-27, PIECE_BYTES=33100000 (three pieces).
# - XZ_OPTS (default -9e): -6 compresses in a few minutes on a busy 2-core machine where -9e takes most of an hour;
#   its set was 99.2 MB (2026-11-27).
# - A mixture of experts needs the MoE kernels this set drops (vllm/_moe_C_stable_libtorch.abi3.so, 47.5 MB; 40.4 MB
#   as xz -6): tar that one file from the same vLLM wheel into moe.tar.xz, and send `cat site.tar.xz moe.tar.xz` cut
#   into 4 pieces named bundle.NN with `BUNDLE=4 SITE_BYTES=<site.tar.xz's size> benchmarks/rehearse_on_device.sh`
#   (the held-out qwen3-30b-a3b runs, 2026-11-27).
set -euo pipefail
PY=${PY:-python3.12}
VLLM=${VLLM:-0.26.0}
PIECE_BYTES=${PIECE_BYTES:-46921520}
XZ_OPTS=${XZ_OPTS:--9e}
DEVICE_PACKAGES=${DEVICE_PACKAGES:?set DEVICE_PACKAGES to a file of the package names the GPU machine has, comma-separated}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux2010_x86_64)
for n in $(seq 5 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
pick=(--only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}")

"$PY" -m pip download -q --no-deps "${pick[@]}" -d "$work/vllm" "vllm==$VLLM"
"$PY" -m pip install -q --dry-run --ignore-installed --target "$work/none" "${pick[@]}" --report "$work/report.json" \
    "$work"/vllm/vllm-*.whl
"$PY" - "$work/report.json" "$DEVICE_PACKAGES" >"$work/keep.txt" <<'EOF'
import json, re, sys
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
there = {norm(x.strip().rstrip(".")) for x in open(sys.argv[2]).read().split(",") if x.strip()}
drop = {"vllm", "flashinfer-python", "cuda-tile", "pynvvideocodec", "tilelang", "z3-solver", "torch-c-dlpack-ext",
        "tokenspeed-mla", "tokenspeed-triton", "cuda-python", "nvidia-cuda-nvdisasm", "fastsafetensors",
        "nvidia-cudnn-frontend", "quack-kernels", "torchcodec", "humming-kernels", "nvidia-cuda-nvcc",
        "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl", "apache-tvm-ffi"}
for item in json.load(open(sys.argv[1]))["install"]:
    name = norm(item["metadata"]["name"])
    if name not in there and name not in drop and not name.startswith("nvidia-cutlass-dsl"):
        print(f"{name}=={item['metadata']['version']}")
print("apache-tvm-ffi==0.1.15.post2")
EOF
"$PY" -m pip download -q --no-deps "${pick[@]}" -d "$work/wheels" -r "$work/keep.txt"
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$work"/wheels/*.whl \
    "$work"/vllm/vllm-*.whl
(
    cd "$work/site"
    rm -rf vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
        vllm/third_party/fmha_sm100/cutlass vllm/third_party/fmha_sm100/cute mistral_common/data/tekken_*.json \
        pycountry/locales bin
    find vllm/third_party/deep_gemm -name '_C.cpython-3*.so' ! -name '*cpython-312*' -delete
    find . -name __pycache__ -type d -prune -exec rm -rf {} +
)
tar -C "$work/site" -cf - . | xz "$XZ_OPTS" -T2 >"$work/site.tar.xz"
mkdir -p .whl
rm -f .whl/site.tar.xz.* .whl/bundle.*
if [ -z "${RAY:-}" ]; then
    split -b "$PIECE_BYTES" -d -a 2 "$work/site.tar.xz" .whl/site.tar.xz.
    ls -l .whl/site.tar.xz.*
    echo "send them with: PIECES=$(find .whl -name 'site.tar.xz.*' | wc -l) benchmarks/rehearse_on_device.sh ..."
    exit 0
fi
# RAY=VERSION (the launcher's multi-node jobs with Ray): Ray and what it needs beyond the set and the machine, as a
# second stream after the set; rehearse_on_device.sh unpacks the two from BUNDLE pieces given SITE_BYTES.
"$PY" -m pip install -q --dry-run --ignore-installed --target "$work/none" "${pick[@]}" --report "$work/ray.json" \
    "ray==$RAY"
"$PY" - "$work/ray.json" "$DEVICE_PACKAGES" "$work/keep.txt" >"$work/ray.txt" <<'EOF2'
import json, re, sys
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
there = {norm(x.strip().rstrip(".")) for x in open(sys.argv[2]).read().split(",") if x.strip()}
there |= {norm(line.split("==")[0]) for line in open(sys.argv[3]) if line.strip()}  # in the set already
for item in json.load(open(sys.argv[1]))["install"]:
    if norm(item["metadata"]["name"]) not in there:
        print(f"{item['metadata']['name']}=={item['metadata']['version']}")
EOF2
"$PY" -m pip download -q --no-deps "${pick[@]}" -d "$work/ray-wheels" -r "$work/ray.txt"
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$work/ray-site" "$work"/ray-wheels/*.whl
find "$work/ray-site" -name __pycache__ -type d -prune -exec rm -rf {} +
tar -C "$work/ray-site" -cf - . | xz "$XZ_OPTS" -T2 >"$work/ray.tar.xz"
cat "$work/site.tar.xz" "$work/ray.tar.xz" | split -b "$PIECE_BYTES" -d -a 2 - .whl/bundle.
ls -l .whl/bundle.*
echo "send them with: BUNDLE=$(find .whl -name 'bundle.*' | wc -l) SITE_BYTES=$(stat -c %s "$work/site.tar.xz")" \
    "benchmarks/rehearse_on_device.sh ..."
