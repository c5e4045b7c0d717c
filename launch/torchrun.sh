#!/usr/bin/env bash
# Launch a job on this node: one rank per GPU (or CPU rank), sized from the job spec.
#   launch/torchrun.sh JOB.toml [key=value ...]
# MRL_COMMAND picks the mrl subcommand (default: train; e.g. MRL_COMMAND=preflight).
set -euo pipefail
JOB=${1:?usage: launch/torchrun.sh JOB.toml [key=value ...]}
cd "$(dirname "$0")/.."
VENV=${MRL_VENV:-.venv}
mrl() { "$VENV/bin/python" -m mrl "$@"; }
mrl validate "$@" >/dev/null   # a bad spec fails here, before any rank starts
NODES=$(mrl show "$@" --get platform.nodes)
RANKS=$(mrl show "$@" --get platform.ranks_per_node)
if [ "$NODES" != 1 ]; then
  echo "error: $JOB: platform.nodes = $NODES; launch multi-node jobs with:" \
       "sbatch --nodes $NODES --ntasks-per-node $RANKS launch/slurm.sh$(printf ' %q' "$@")" >&2
  exit 2
fi
# mrl launch runs torchrun --standalone --nproc_per_node $RANKS in-process: a user error on the ranks
# is printed once and exits 2, without torchrun's ChildFailedError report.
exec "$VENV/bin/python" -m mrl launch --run "${MRL_COMMAND:-train}" "$@"
