#!/usr/bin/env bash
# Pack vLLM's Python sources (its Triton LoRA kernels and what they import) for the lent GPU
# machine, which has no vLLM and no network, so benchmarks/sgmv.py can time vLLM's
# lora_shrink + lora_expand in the same run as ours (--vllm). Writes ./.vllm-peer (git-ignored):
# one tar.xz of the sources (no compiled extensions: they need torch 2.14, the device has 2.11,
# and the LoRA ops are pure Triton) plus pyzmq, the one import the device image lacks.
#
#   usage (from the project root):  benchmarks/make-vllm-bundle.sh
#   then on the device:             source .vllm-peer/install.sh   (name .vllm-peer in `carry`)
set -euo pipefail
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
OUT_DIR=.vllm-peer
rm -rf "$OUT_DIR" && mkdir -p "$OUT_DIR" && TMP="$(mktemp -d)"
PLAT=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
  -d "$TMP" "vllm==$VLLM_VERSION" pyzmq
mkdir -p "$TMP/site"
# the dist-info lets vLLM read its own version, which its CUDA platform detection needs
unzip -q "$TMP"/vllm-*.whl -d "$TMP/site" -x '*.so' 'vllm/vllm-rs' 'vllm/third_party/deep_gemm/*' 'vllm/third_party/fmha_sm100/*' 'vllm-*.dist-info/RECORD'
unzip -q "$TMP"/pyzmq-*.whl -d "$TMP/site"
tar -C "$TMP/site" -cf - . | xz -T0 -6 > "$OUT_DIR/site.tar.xz"
cat > "$OUT_DIR/install.sh" <<'SH'
# Source on the GPU machine, from the repo root: unpacks vLLM's sources into /tmp/vllm-site.
_D="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
rm -rf /tmp/vllm-site && mkdir -p /tmp/vllm-site && tar -xJf "$_D/site.tar.xz" -C /tmp/vllm-site
export VLLM_PEER_SITE=/tmp/vllm-site
SH
rm -rf "$TMP"
du -sh "$OUT_DIR"
