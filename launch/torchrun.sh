#!/usr/bin/env bash
# Launch a job on this node: one rank per GPU (or CPU rank), sized from the job spec.
#   launch/torchrun.sh JOB.toml [key=value ...]
# Works from any directory: the job path and overrides are read against the working directory.
# MRL_COMMAND picks the mrl subcommand (default: train; e.g. MRL_COMMAND=preflight).
set -euo pipefail
JOB=${1:?usage: launch/torchrun.sh JOB.toml [key=value ...]}
HERE=$(cd "$(dirname "$0")/.." && pwd)
VENV=${MRL_VENV:-.venv}
case $VENV in /*) ;; *) VENV=$HERE/$VENV ;; esac   # a relative MRL_VENV is under the repository
export PYTHONPATH=$HERE${PYTHONPATH:+:$PYTHONPATH}  # this checkout's mrl, from any directory
mrl() { "$VENV/bin/python" -m mrl "$@"; }
# One Python before torchrun: it validates the job (a bad spec fails here, before any rank starts)
# and reads its size.
SIZE=$(mrl show "$@" --get platform.nodes --get platform.ranks_per_node)   # set -e: its exit code
NODES=${SIZE%%$'\n'*}
RANKS=${SIZE##*$'\n'}
if [ "$NODES" != 1 ]; then
  echo "error: $JOB: platform.nodes = $NODES; launch multi-node jobs with:" \
       "sbatch --nodes $NODES --ntasks-per-node $RANKS launch/slurm.sh$(printf ' %q' "$@")" >&2
  exit 2
fi
# mrl launch runs torchrun --standalone --nproc_per_node $RANKS in-process: a user error on the ranks
# is printed once and exits 2, without torchrun's ChildFailedError report.
exec "$VENV/bin/python" -m mrl launch --run "${MRL_COMMAND:-train}" "$@"
