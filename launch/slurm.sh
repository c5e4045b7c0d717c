#!/usr/bin/env bash
# Run an mrl job on a Slurm allocation: one task per rank, SPMD, no Ray.
#   sbatch --nodes N --ntasks-per-node M launch/slurm.sh JOB.toml [key=value ...]
# N x M must equal the job's platform.nodes x platform.ranks_per_node; the script checks it before
# any rank starts. Ranks read SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; the rendezvous address
# is the first node of the allocation. MRL_COMMAND picks the subcommand (default: train;
# e.g. MRL_COMMAND=preflight); MRL_VENV the virtualenv (default: .venv in the submit directory).
# Command-line options override the #SBATCH lines below: on a cluster without GPUs (or to run a
# CPU job such as jobs/quickstart_cpu.toml) add --gpus-per-node=0.
#SBATCH --job-name=mrl
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
JOB=${1:?usage: sbatch launch/slurm.sh JOB.toml [key=value ...]}
cd "${SLURM_SUBMIT_DIR:-$(pwd)}"
VENV=${MRL_VENV:-.venv}
PY="$VENV/bin/python"

"$PY" -m mrl validate "$@"
NODES=$("$PY" -m mrl show "$@" --get platform.nodes)
RANKS=$("$PY" -m mrl show "$@" --get platform.ranks_per_node)
HAVE_NODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
HAVE_TASKS=${SLURM_NTASKS:-0}
if [ "$HAVE_NODES" != "$NODES" ] || [ "$HAVE_TASKS" != $((NODES * RANKS)) ]; then
  # The resubmit command keeps a GPU count the user chose over the #SBATCH default, and quotes
  # the job arguments so that it can be pasted as is.
  GPUS=""
  if [ -n "${SLURM_GPUS_PER_NODE:-}" ] && [ "$SLURM_GPUS_PER_NODE" != 8 ]; then
    GPUS=" --gpus-per-node $(printf '%q' "$SLURM_GPUS_PER_NODE")"
  fi
  echo "error: $JOB wants platform.nodes $NODES x platform.ranks_per_node $RANKS = $((NODES * RANKS)) ranks;" \
       "this allocation has $HAVE_NODES node(s) and $HAVE_TASKS task(s)." \
       "Submit with: sbatch --nodes $NODES --ntasks-per-node $RANKS$GPUS launch/slurm.sh$(printf ' %q' "$@")" >&2
  exit 2
fi

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
srun --kill-on-bad-exit=1 --ntasks-per-node "$RANKS" "$PY" -m mrl "${MRL_COMMAND:-train}" "$@"
