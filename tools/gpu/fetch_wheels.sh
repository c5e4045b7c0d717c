#!/usr/bin/env bash
# Download the wheels of tools/gpu/wheels.txt for a GPU box, on any machine with PyPI access:
#   tools/gpu/fetch_wheels.sh [DIR] [PYTHON_VERSION]      # default .whl and 3.12 (CPython, manylinux x86_64)
# then carry DIR to the box and run `tools/gpu/check.sh --wheels DIR` (or `make gpu-check WHEELS=DIR`).
# Nothing is installed here: pip only downloads binary wheels for the target interpreter.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dir="${1:-.whl}"
pyver="${2:-3.12}"
py="${PYTHON:-python3}"
mkdir -p "$dir"
grep -v '^\s*#' "$here/wheels.txt" | grep -v '^\s*$' | xargs "$py" -m pip download --quiet --no-deps \
    --only-binary=:all: --implementation cp --python-version "$pyver" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir"
ls -l "$dir"/*.whl
du -ch "$dir"/*.whl | tail -1
