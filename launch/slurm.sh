#!/usr/bin/env bash
# Run an mrl job on a Slurm allocation: one task per rank, SPMD, no Ray.
#   sbatch --nodes N --ntasks-per-node M launch/slurm.sh JOB.toml [key=value ...]
# N x M must equal the job's platform.nodes x platform.ranks_per_node; the script checks it before
# any rank starts. Ranks read SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; the rendezvous address
# is the first node of the allocation. MRL_COMMAND picks the subcommand (default: train;
# e.g. MRL_COMMAND=preflight); MRL_VENV the virtualenv (default: .venv in the submit directory).
# Command-line options override the #SBATCH lines below: on a cluster without GPUs (or to run a
# CPU job such as jobs/quickstart_cpu.toml) add --gpus-per-node=0.
# Logs: Slurm writes everything to slurm-mrl-<jobid>.out in the submit directory (or --output);
# once the job is checked, the same lines from then on (the validation result, then every rank's
# output) also go to <job.output_dir>/<job.name>/slurm-<jobid>.out, next to the run's
# checkpoints and mlflow.db. A job refused before launch (bad spec, wrong allocation) has only the
# first. See launch/README.md.
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

VALID=$("$PY" -m mrl validate "$@" 2>&1) || { rc=$?; printf '%s\n' "$VALID" >&2; exit "$rc"; }
# One `mrl show` for the four values the script needs (each run of mrl costs seconds of imports).
SPEC=$("$PY" -m mrl show "$@" | "$PY" -c 'import sys, tomllib
t = tomllib.loads(sys.stdin.read())
print(t["platform"]["nodes"], t["platform"]["ranks_per_node"], t["job"]["output_dir"], t["job"]["name"], sep="\n")')
{ read -r NODES; read -r RANKS; IFS= read -r OUTPUT_DIR; IFS= read -r NAME; } <<<"$SPEC"
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
RUN_DIR="$OUTPUT_DIR/$NAME"
mkdir -p "$RUN_DIR"
LOG="$RUN_DIR/slurm-$SLURM_JOB_ID.out"
{ printf '%s\n' "$VALID"
  echo "mrl: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: $((NODES * RANKS)) rank(s), rendezvous $MASTER_ADDR:$MASTER_PORT," \
       "run directory $RUN_DIR, log $LOG"
} | tee -a "$LOG"
# pipefail (set above): the script exits with srun's status, not tee's.
srun --kill-on-bad-exit=1 --ntasks-per-node "$RANKS" "$PY" -m mrl "${MRL_COMMAND:-train}" "$@" 2>&1 | tee -a "$LOG"
