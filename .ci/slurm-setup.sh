#!/usr/bin/env bash
# Bring up a one-node Slurm on this machine (munged + slurmctld + slurmd, all local) so the launch
# test tier can run `sbatch launch/slurm.sh ...` for real. Run as root; CI runs it before `make test`.
#   bash .ci/slurm-setup.sh
# Idempotent: installs slurm-wlm + munge only when missing, rewrites slurm.conf only when it changes
# (restarting the daemons if so), starts only daemons that are not running, then waits until the
# node is usable. A second run with everything up takes about 0.1 s.
# No systemd needed: daemons are started directly. No cgroups (proctrack/linuxproc, task/none),
# no accounting, no GPUs (submit with --gpus-per-node=0 or leave GPU flags out, see launch/slurm.sh).
# Env: SLURM_SETUP_TIMEOUT  seconds to wait for the node to come up (default 90)
#      SLURM_SETUP_FORCE=1  overwrite an /etc/slurm/slurm.conf this script did not write
set -euo pipefail

TIMEOUT=${SLURM_SETUP_TIMEOUT:-90}
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARK="# written by mrl .ci/slurm-setup.sh"
LOG_DIR=/var/log/slurm
T0=$(date +%s.%N)

say() { echo "slurm-setup: $*"; }
die() { echo "slurm-setup: error: $*" >&2; exit 1; }
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
pid_alive() {  # pid file $1 names a live process called $2 (a stale pid may have been reused)
  local pid
  pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}
show_logs() {
  for f in "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" /var/log/munge/munged.log; do
    [ -f "$f" ] && { echo "--- tail $f" >&2; tail -n 20 "$f" >&2; }
  done
  return 0
}

[ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts daemons)"

# --- 1. packages --------------------------------------------------------------------------------
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
missing=()
for p in slurm-wlm slurmctld slurmd slurm-client munge; do installed "$p" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=120 update -qq </dev/null || die "apt-get update failed"
  apt-get -o DPkg::Lock::Timeout=120 install -y -qq --no-install-recommends \
    -o Dpkg::Options::=--force-confold slurm-wlm munge </dev/null >/dev/null \
    || die "apt-get install slurm-wlm munge failed"
  say "installed in $(elapsed)s"
fi
for b in munged munge slurmctld slurmd sbatch sinfo scontrol; do
  command -v "$b" >/dev/null || die "$b not on PATH after installing slurm-wlm and munge"
done

# --- 2. host name -------------------------------------------------------------------------------
# Slurm names the node after the short host name, and launch/slurm.sh hands that name to the ranks
# as MASTER_ADDR, so it must resolve. Daemons talk over 127.0.0.1 whatever it resolves to.
NODE=$(hostname -s)
[ -n "$NODE" ] || die "hostname -s printed nothing"
if ! getent hosts "$NODE" >/dev/null; then
  say "$NODE does not resolve; adding it to /etc/hosts as 127.0.0.1"
  echo "127.0.0.1 $NODE" >>/etc/hosts
fi
NCPU=$(nproc)

# --- 3. slurm.conf ------------------------------------------------------------------------------
# MinJobAge=4 keeps `sbatch --wait` polling every 2 s (it backs off to 8 s, then 32 s, while
# its poll interval is below MinJobAge/2). Finished jobs were measured to stay visible 8-12 s,
# several polls; the tests still reject sbatch's "no longer found" answer, which exits 0.
new_conf="$MARK
ClusterName=mrl-ci
SlurmctldHost=$NODE(127.0.0.1)
AuthType=auth/munge
CryptoType=crypto/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=none
SwitchType=switch/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=4
KillWait=5
InactiveLimit=0
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$NCPU State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP"

mkdir -p "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd
conf_changed=0
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$new_conf" ]; then
  if [ -f "$CONF" ] && ! head -n 1 "$CONF" | grep -qF "$MARK" && [ "${SLURM_SETUP_FORCE:-0}" != 1 ]; then
    die "$CONF exists and was not written by this script; set SLURM_SETUP_FORCE=1 to replace it"
  fi
  printf '%s\n' "$new_conf" >"$CONF.tmp" && mv "$CONF.tmp" "$CONF"
  conf_changed=1
  say "wrote $CONF (node $NODE, $NCPU CPUs, partition debug)"
fi

# --- 4. munge -----------------------------------------------------------------------------------
KEY=/etc/munge/munge.key
if [ ! -s "$KEY" ]; then
  say "creating munge key"
  mkdir -p /etc/munge
  if command -v mungekey >/dev/null; then mungekey --create --keyfile="$KEY" --force
  else dd if=/dev/urandom of="$KEY" bs=1 count=1024 status=none; fi
fi
chown munge:munge /etc/munge "$KEY"
chmod 0700 /etc/munge
chmod 0400 "$KEY"
munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! munge_ok; then
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  chmod 0755 /run/munge
  say "starting munged"
  runuser -u munge -- /usr/sbin/munged </dev/null || { show_logs; die "munged failed to start"; }
  for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
  munge_ok || { show_logs; die "munged started but munge -n | unmunge fails"; }
fi

# --- 5. slurmctld and slurmd --------------------------------------------------------------------
stop() {  # stop a daemon we can identify by its pid file, and wait for it to exit
  local pidf=$1 pid
  pid_alive "$pidf" "$(basename "$pidf" .pid)" || return 0
  pid=$(cat "$pidf")
  kill "$pid"
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  die "$(basename "$pidf" .pid) (pid $pid) did not stop within 10 s"
}
if [ "$conf_changed" = 1 ]; then
  stop /run/slurmd.pid
  stop /run/slurmctld.pid
fi
if ! pid_alive /run/slurmctld.pid slurmctld; then
  say "starting slurmctld"
  slurmctld </dev/null || { show_logs; die "slurmctld failed to start"; }
fi
if ! pid_alive /run/slurmd.pid slurmd; then
  say "starting slurmd"
  slurmd </dev/null || { show_logs; die "slurmd failed to start"; }
fi

# --- 6. wait for the node -----------------------------------------------------------------------
# Ready: the controller reports the node idle, or busy with jobs (a second run while tests are
# running must not wait for them), and the local slurmd answers.
deadline=$(( $(date +%s) + TIMEOUT ))
resumed=0
state=""
while :; do
  state=$(timeout 15 sinfo -h -N -n "$NODE" -o '%t' 2>/dev/null | head -n 1 || true)
  case "$state" in
    idle|mix|alloc|comp) timeout 15 scontrol show slurmd >/dev/null 2>&1 && break ;;
    drain*|drng*|down*|fail*)  # ReturnToService=2 normally clears these; resume once if not
      if [ "$resumed" = 0 ]; then
        scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
        resumed=1
      fi ;;
  esac
  if [ "$(date +%s)" -ge "$deadline" ]; then
    sinfo -N -l >&2 || true
    scontrol show node "$NODE" >&2 || true
    show_logs
    die "node $NODE not up after ${TIMEOUT}s (state '${state:-no answer}')"
  fi
  sleep 0.2
done
say "node $NODE is $state in partition debug; ready in $(elapsed)s"
