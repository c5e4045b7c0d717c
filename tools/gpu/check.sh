#!/usr/bin/env bash
# Check this machine for mrl end to end (tools/gpu/check.py; CONTRIBUTING.md, "The GPU tier"):
#   tools/gpu/check.sh [--wheels DIR] [--out DIR] [--quick] [--budget-s S]
# The interpreter is $GPU_PYTHON, else $PYTHON, else python3; $WHEELS is the default --wheels.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${GPU_PYTHON:-${PYTHON:-python3}}"
exec "$py" "$here/check.py" "$@"
