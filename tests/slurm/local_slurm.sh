#!/usr/bin/env bash
# tests/slurm/local_slurm.sh - a real multi-node Slurm cluster on this machine, for the tests.
#
# Usage:
#   bash tests/slurm/local_slurm.sh start    # install (Debian packages, as root) if needed, configure, start
#   bash tests/slurm/local_slurm.sh status   # sinfo
#   bash tests/slurm/local_slurm.sh stop     # scancel everything, stop the daemons by their recorded PIDs
#   source <(bash tests/slurm/local_slurm.sh env)   # export SLURM_CONF for client commands
#
# Four virtual nodes node[1-4] (NodeAddr 127.0.0.1, one slurmd each), 4 fake GPUs per node (gres files are
# symlinks to /dev/null), munge auth, fast scheduling, requeue after ~11 s (cred_expire=10).
# Knobs: PIPELINE_SLURM_BASE (default /tmp/pslurm; keep it short: the munge socket path must stay < 108 bytes),
# SLURMCTLD_PORT (16817), SLURMD_PORT_BASE (17001), SLURM_NODE_CPUS (2).
set -euo pipefail
BASE="${PIPELINE_SLURM_BASE:-/tmp/pslurm}"
CTLD_PORT="${SLURMCTLD_PORT:-16817}"
SLURMD_PORT_BASE="${SLURMD_PORT_BASE:-17001}"
NODE_CPUS="${SLURM_NODE_CPUS:-2}"
NODES=(node1 node2 node3 node4)
CONF="$BASE/etc/slurm.conf"

log() { echo "local_slurm: $*" >&2; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null; then
    return 0
  fi
  [[ $(id -u) -eq 0 ]] || { log "Slurm is not installed and this is not root: cannot install"; return 1; }
  log "installing slurmctld slurmd slurm-client munge (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  # Debian's postinst may try to start system daemons; a policy-rc.d refusal keeps it from doing so.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  rm -f /usr/sbin/policy-rc.d
}

write_config() {
  mkdir -p "$BASE"/{etc,state,log,run,munge,dev}
  chmod 755 "$BASE" "$BASE/munge"
  for i in 0 1 2 3; do ln -sf /dev/null "$BASE/dev/gpu$i"; done
  for n in "${NODES[@]}"; do mkdir -p "$BASE/spool/$n"; done
  if [[ ! -f "$BASE/munge/munge.key" ]]; then
    if command -v mungekey >/dev/null; then mungekey --create --keyfile="$BASE/munge/munge.key" >/dev/null 2>&1
    else dd if=/dev/urandom of="$BASE/munge/munge.key" bs=1024 count=1 status=none; fi
    chmod 600 "$BASE/munge/munge.key"
  fi
  cat > "$CONF" <<EOC
ClusterName=pipelinetest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$BASE/munge/munge.socket,cred_expire=10
CryptoType=crypto/munge
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=1
EnforcePartLimits=ALL
JobCompType=jobcomp/filetxt
JobCompLoc=$BASE/log/jobcomp.txt
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=300
KillWait=10
GresTypes=gpu
NodeName=node[1-4] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$SLURMD_PORT_BASE-$((SLURMD_PORT_BASE + 3))] CPUs=$NODE_CPUS RealMemory=4000 Gres=gpu:4 State=UNKNOWN
PartitionName=debug Nodes=node[1-4] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOC
  echo "NodeName=node[1-4] Name=gpu File=$BASE/dev/gpu[0-3]" > "$BASE/etc/gres.conf"
}

pid_alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  install_packages || exit 1
  if pid_alive "$BASE/run/slurmctld.pid"; then log "already running ($BASE)"; return 0; fi
  write_config
  export SLURM_CONF="$CONF"
  munged --key-file="$BASE/munge/munge.key" --socket="$BASE/munge/munge.socket" \
    --pid-file="$BASE/run/munged.pid" --log-file="$BASE/log/munged.log" --seed-file="$BASE/munge/munge.seed" --force
  slurmctld -f "$CONF"
  for n in "${NODES[@]}"; do slurmd -N "$n" -f "$CONF"; done
  for _ in $(seq 1 60); do
    if sinfo -h -o '%t' 2>/dev/null | grep -qx idle && [[ "$(sinfo -h -N -o '%t' | grep -cx idle)" -eq ${#NODES[@]} ]]; then
      log "up: ${#NODES[@]} nodes idle (SLURM_CONF=$CONF)"; return 0
    fi
    sleep 0.5
  done
  log "nodes did not become idle; see $BASE/log/"; sinfo -N >&2 || true; exit 1
}

stop() {
  export SLURM_CONF="$CONF"
  if [[ -f "$CONF" ]] && pid_alive "$BASE/run/slurmctld.pid"; then
    scancel --quiet --user "$(id -un)" 2>/dev/null || true
    for _ in $(seq 1 20); do [[ -z "$(squeue -h 2>/dev/null)" ]] && break; sleep 0.5; done
  fi
  for n in "${NODES[@]}"; do
    if pid_alive "$BASE/run/slurmd-$n.pid"; then kill "$(cat "$BASE/run/slurmd-$n.pid")" || true; fi
  done
  if pid_alive "$BASE/run/slurmctld.pid"; then kill "$(cat "$BASE/run/slurmctld.pid")" || true; fi
  sleep 1
  # Job steps orphaned by a dead slurmd ignore SIGTERM: end them by PID.
  for p in $(pgrep -f "slurmstepd: \[" || true); do kill -9 "$p" 2>/dev/null || true; done
  if pid_alive "$BASE/run/munged.pid"; then kill "$(cat "$BASE/run/munged.pid")" || true; fi
  log "stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) SLURM_CONF="$CONF" sinfo -N ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0" ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
