#!/usr/bin/env bash
# A one-node Slurm on this machine (Debian's slurmctld + slurmd + munge), for the tests that attach the lab
# to `ipcluster start --engines=slurm`. Run as root:  .ci/slurm_single_node.sh start | stop | status
# No cgroups are needed (proctrack/linuxproc, task/none), so it also runs in a container. The node declares
# at least 8 CPUs (config_overrides) so that a 4-engine job fits on a 2-core machine.
# `stop` stops what `start` started, by PID: slurmd, slurmctld, and munged unless it was already running.
# On failure it prints "slurm: cannot start: <what failed>" on stderr and exits 1; the tests skip with that line.
set -uo pipefail
STATE=/var/lib/cluster-lab-slurm
CONF=/etc/slurm/slurm.conf
HOST=$(hostname -s)

fail() { echo "slurm: cannot start: $*" >&2; exit 1; }

write_config() {
  local cpus; cpus=$(nproc); (( cpus < 8 )) && cpus=8
  mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" || fail "cannot create /etc/slurm or $STATE"
  cat > "$CONF" <<CONF
# Written by cluster-lab's .ci/slurm_single_node.sh: one node, no cgroups.
ClusterName=lab
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=lab Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
}

start_munge() {
  [ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || fail "no /etc/munge/munge.key and mungekey failed"; }
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge && chown munge:munge /run/munge
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged || fail "munged did not start (see /var/log/munge/munged.log)"
    cp /run/munge/munged.pid "$STATE/munged.pid"  # ours to stop; a munged already running is the machine's
  fi
  munge -n | unmunge >/dev/null 2>&1 || fail "munge cannot encode and decode a credential"
}

# A daemon counts as running while its pidfile names a live process (a zombie, exited but not reaped, does not).
running() {
  local pid state
  pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] || return 1
  state=$(ps -o stat= -p "$pid") || return 1
  [[ $state != Z* ]]
}

start() {
  [ "$(id -u)" = 0 ] || fail "this script needs root (it writes $CONF and starts daemons)"
  for cmd in slurmctld slurmd munged sinfo; do
    command -v "$cmd" >/dev/null || [ -x "/usr/sbin/$cmd" ] || fail "$cmd is not installed (apt-get install slurm-wlm munge)"
  done
  write_config
  start_munge
  running "$STATE/slurmctld.pid" || /usr/sbin/slurmctld || fail "slurmctld did not start: $(tail -n 3 "$STATE/slurmctld.log" 2>/dev/null)"
  running "$STATE/slurmd.pid" || /usr/sbin/slurmd || fail "slurmd did not start: $(tail -n 3 "$STATE/slurmd.log" 2>/dev/null)"
  for _ in $(seq 60); do
    if sinfo -h -N -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
      echo "slurm: up, node $HOST idle"; return 0
    fi
    sleep 1
  done
  fail "the node never became idle: $(sinfo -h -N -o '%N %t %E' 2>&1 | head -n 2); slurmd log: $(tail -n 3 "$STATE/slurmd.log" 2>/dev/null)"
}

stop() {
  # Only the daemons this script started, by the PIDs they wrote (munged only if this script started it).
  for name in slurmd slurmctld munged; do
    if running "$STATE/$name.pid"; then kill "$(cat "$STATE/$name.pid")"; fi
  done
  for _ in $(seq 20); do
    running "$STATE/slurmd.pid" || running "$STATE/slurmctld.pid" || running "$STATE/munged.pid" || {
      rm -f "$STATE/munged.pid"; return 0; }
    sleep 0.5
  done
  echo "slurm: daemons still running after 10 s" >&2; return 1
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status) running "$STATE/slurmctld.pid" && running "$STATE/slurmd.pid" && sinfo ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
