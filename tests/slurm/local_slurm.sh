#!/usr/bin/env bash
# tests/slurm/local_slurm.sh - a real multi-node Slurm cluster on this machine, for the tests.
#
# Usage:
#   bash tests/slurm/local_slurm.sh start    # install (Debian packages, as root) if needed, configure, start
#   bash tests/slurm/local_slurm.sh status   # sinfo
#   bash tests/slurm/local_slurm.sh stop     # cancel this cluster's jobs, stop its daemons by their recorded PIDs
#   source <(bash tests/slurm/local_slurm.sh env)   # export SLURM_CONF for client commands
#
# Four virtual nodes node[1-4] (NodeAddr 127.0.0.1, one slurmd each), 4 fake GPUs per node (gres files are
# symlinks to /dev/null), munge auth, fast scheduling, requeue after ~11 s (cred_expire=10).
# Each cluster lives in its own base directory (config, state, logs, munge socket, PIDs), and `start` picks free
# TCP ports for the controller and each slurmd and writes them into that config, so clusters run side by side
# (two test runs, another Slurm on the host); `stop` cancels only this cluster's jobs and ends only its own
# daemons and job steps. A start that fails ends with one line: the cause and the log to read.
# Knobs: PIPELINE_SLURM_BASE (default /tmp/pslurm; keep it short: the munge socket path must stay < 108 bytes),
# SLURMCTLD_PORT and SLURMD_PORT_BASE (fixed ports instead of free ones: the slurmds take BASE..BASE+3; a fixed
# port in use is refused), SLURM_NODE_CPUS (2).
set -euo pipefail
BASE="${PIPELINE_SLURM_BASE:-/tmp/pslurm}"
NODE_CPUS="${SLURM_NODE_CPUS:-2}"
NODES=(node1 node2 node3 node4)
CONF="$BASE/etc/slurm.conf"
START_TRIES=3

log() { echo "local_slurm: $*" >&2; }
die() { log "error: $*"; exit 1; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null; then
    return 0
  fi
  [[ $(id -u) -eq 0 ]] || die "Slurm is not installed and this is not root: cannot install it"
  log "installing slurmctld slurmd slurm-client munge (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  # Debian's postinst may try to start system daemons; a policy-rc.d refusal keeps it from doing so.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null \
    || { rm -f /usr/sbin/policy-rc.d; die "apt-get could not install slurmctld slurmd slurm-client munge"; }
  rm -f /usr/sbin/policy-rc.d
}

# "CTLD NODE1 NODE2 NODE3 NODE4": free ports are found by binding them all at once on every address (distinct,
# and free on 0.0.0.0 where the daemons listen); fixed ones (SLURMCTLD_PORT, SLURMD_PORT_BASE) are checked free.
pick_ports() {
  python3 -c '
import socket, sys
ctld, base, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
want = [int(ctld) if ctld else 0] + ([int(base) + i for i in range(n)] if base else [0] * n)
names = ["SLURMCTLD_PORT"] + [f"SLURMD_PORT_BASE+{i}" for i in range(n)]
held = []
for port, name in zip(want, names):
    s = socket.socket()
    try:
        s.bind(("", port))
    except OSError as exc:
        sys.exit(f"port {port} ({name}) is already in use ({exc.strerror})")
    held.append(s)
print(" ".join(str(s.getsockname()[1]) for s in held))
' "${SLURMCTLD_PORT:-}" "${SLURMD_PORT_BASE:-}" "${#NODES[@]}"
}

write_config() {
  local ports ctld_port node_lines="" i=0 p
  mkdir -p "$BASE"/{etc,state,log,run,munge,dev} 2>/dev/null || die "cannot create the cluster's base directory $BASE"
  chmod 755 "$BASE" "$BASE/munge"
  for i in 0 1 2 3; do ln -sf /dev/null "$BASE/dev/gpu$i"; done
  for n in "${NODES[@]}"; do mkdir -p "$BASE/spool/$n"; done
  if [[ ! -f "$BASE/munge/munge.key" ]]; then
    if command -v mungekey >/dev/null; then mungekey --create --keyfile="$BASE/munge/munge.key" >/dev/null 2>&1
    else dd if=/dev/urandom of="$BASE/munge/munge.key" bs=1024 count=1 status=none; fi
    chmod 600 "$BASE/munge/munge.key"
  fi
  ports=$(pick_ports 2>&1) || die "$ports"
  read -r ctld_port _ <<< "$ports"
  i=0
  for p in ${ports#* }; do
    node_lines+="NodeName=${NODES[$i]} NodeHostname=localhost NodeAddr=127.0.0.1 Port=$p CPUs=$NODE_CPUS RealMemory=4000 Gres=gpu:4 State=UNKNOWN"$'\n'
    i=$((i + 1))
  done
  # Job ids start at a value drawn per cluster, so a fresh cluster's jobs never append to the logs an earlier cluster's
  # jobs left in the repository (logs/slurm/train-%j.out is opened in append mode).
  first_job=$(( (RANDOM * 32768 + RANDOM) % 50000000 + 1000 ))
  cat > "$CONF" <<EOC
ClusterName=pipelinetest
FirstJobId=$first_job
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$ctld_port
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
${node_lines}PartitionName=debug Nodes=node[1-4] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOC
  echo "NodeName=node[1-4] Name=gpu File=$BASE/dev/gpu[0-3]" > "$BASE/etc/gres.conf"
}

pid_alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# The first error a daemon logged (one line), for the failure message.
first_error() {
  grep -hE "(fatal|error):" "$BASE"/log/slurmctld.log "$BASE"/log/slurmd-*.log "$BASE"/log/munged.log 2>/dev/null \
    | grep -v "Unable to register" | head -1 | sed -E 's/^\[[^]]*\] //' || true
}

all_idle() {
  [[ "$(sinfo -h -N -o '%t' 2>/dev/null | grep -cx idle)" -eq ${#NODES[@]} ]]
}

stop_daemons() {
  local n
  for n in "${NODES[@]}"; do
    if pid_alive "$BASE/run/slurmd-$n.pid"; then kill "$(cat "$BASE/run/slurmd-$n.pid")" || true; fi
  done
  if pid_alive "$BASE/run/slurmctld.pid"; then kill "$(cat "$BASE/run/slurmctld.pid")" || true; fi
  sleep 1
}

start() {
  install_packages
  if pid_alive "$BASE/run/slurmctld.pid"; then log "already running ($BASE)"; return 0; fi
  command -v python3 >/dev/null || die "python3 is needed to pick free ports"
  export SLURM_CONF="$CONF"
  local try
  for try in $(seq 1 "$START_TRIES"); do
    write_config
    if ! pid_alive "$BASE/run/munged.pid"; then
      munged --key-file="$BASE/munge/munge.key" --socket="$BASE/munge/munge.socket" \
        --pid-file="$BASE/run/munged.pid" --log-file="$BASE/log/munged.log" --seed-file="$BASE/munge/munge.seed" \
        --force || die "munged did not start; read $BASE/log/munged.log"
    fi
    : > "$BASE/log/slurmctld.log"
    for n in "${NODES[@]}"; do : > "$BASE/log/slurmd-$n.log"; done
    slurmctld -f "$CONF" || true
    for n in "${NODES[@]}"; do slurmd -N "$n" -f "$CONF" || true; done
    for _ in $(seq 1 60); do
      if all_idle; then
        log "up: ${#NODES[@]} nodes idle, controller on port $(sed -n 's/^SlurmctldPort=//p' "$CONF") (SLURM_CONF=$CONF)"
        return 0
      fi
      pid_alive "$BASE/run/slurmctld.pid" || break
      sleep 0.5
    done
    local err
    err=$(first_error)
    stop_daemons
    # A free port taken between choosing it and the daemon's bind: choose again (fixed ports are not retried).
    if [[ "$err" == *"Address already in use"* && -z "${SLURMCTLD_PORT:-}${SLURMD_PORT_BASE:-}" && $try -lt $START_TRIES ]]; then
      log "a chosen port was taken meanwhile ($err); choosing again"
      continue
    fi
    sinfo -N >&2 2>/dev/null || true
    die "the cluster did not come up: ${err:-nodes not idle after 30 s}; read $BASE/log/slurmctld.log and $BASE/log/slurmd-*.log"
  done
}

# Job steps whose slurmd died ignore SIGTERM: end them by PID, but only this cluster's (their SLURM_CONF).
kill_own_steps() {
  local p
  for p in $(pgrep -f "slurmstepd: \[" || true); do
    if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$CONF"; then
      kill -9 "$p" 2>/dev/null || true
    fi
  done
}

stop() {
  export SLURM_CONF="$CONF"
  if [[ -f "$CONF" ]] && pid_alive "$BASE/run/slurmctld.pid"; then
    scancel --quiet --user "$(id -un)" 2>/dev/null || true
    for _ in $(seq 1 20); do [[ -z "$(squeue -h 2>/dev/null)" ]] && break; sleep 0.5; done
  fi
  stop_daemons
  kill_own_steps
  if pid_alive "$BASE/run/munged.pid"; then kill "$(cat "$BASE/run/munged.pid")" || true; fi
  log "stopped ($BASE)"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) SLURM_CONF="$CONF" sinfo -N ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0" ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
