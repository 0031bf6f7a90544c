#!/usr/bin/env bash
# A one-machine Slurm cluster for the launcher tests: munged, slurmctld and slurmd on this host, one node
# (this host's name) in one partition, configuration and state under PTM_SLURM_DIR.
#
#   scripts/slurm_local.sh up     # root; prints the path of slurm.conf on stdout (use it as SLURM_CONF)
#   scripts/slurm_local.sh down   # stops the daemons it started, removes PTM_SLURM_DIR
#
# Needs Debian's slurm-wlm and munge packages (apt-get install slurm-wlm munge). Both commands are idempotent.
# Processes are tracked without cgroups (proctrack/linuxproc), so it also runs in containers.
set -euo pipefail

DIR="${PTM_SLURM_DIR:-/tmp/ptm-slurm}"
CONF="$DIR/slurm.conf"
NODE="$(hostname -s)"

log() { echo "[slurm_local] $*" >&2; }
die() { log "error: $*"; exit 1; }

need() {
  [ "$(id -u)" = 0 ] || die "must run as root (it starts munged, slurmctld and slurmd); try: sudo $0 $*"
  for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] ||
      die "$tool not found; install Debian's slurm-wlm and munge packages (apt-get install slurm-wlm munge)"
  done
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
  local cpus mem
  cpus="$(nproc)"
  mem="$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)"
  cat > "$CONF" <<EOF
ClusterName=ptm-local
SlurmctldHost=$NODE
SlurmctldPort=6917
SlurmdPort=6918
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=10
NodeName=$NODE CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
}

up() {
  if [ -f "$DIR/.ptm-slurm" ] && alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid" &&
     SLURM_CONF="$CONF" sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
    log "already up"
    echo "$CONF"
    return 0
  fi
  down
  [ ! -e "$DIR" ] || die "$DIR exists but was not made by this script; remove it or set PTM_SLURM_DIR"
  trap 'log "set-up failed; see $DIR/*.log"; down' EXIT
  mkdir -p "$DIR/state" "$DIR/spool"
  touch "$DIR/.ptm-slurm"
  write_conf
  if ! alive /run/munge/munged.pid; then
    mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
    [ -f /etc/munge/munge.key ] || die "/etc/munge/munge.key is missing; reinstall munge or run mungekey"
    runuser -u munge -- /usr/sbin/munged 2>/dev/null || /usr/sbin/munged --force
    touch "$DIR/started-munged"
  fi
  /usr/sbin/slurmctld -f "$CONF"
  /usr/sbin/slurmd -f "$CONF"
  local tries=0
  until SLURM_CONF="$CONF" sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; do
    tries=$((tries + 1))
    [ "$tries" -lt 60 ] || die "the node did not become idle within 30 s"
    sleep 0.5
  done
  trap - EXIT
  log "up: node $NODE, partition debug; export SLURM_CONF=$CONF"
  echo "$CONF"
}

down() {
  local pidfile
  for pidfile in "$DIR/slurmd.pid" "$DIR/slurmctld.pid"; do
    if alive "$pidfile"; then kill "$(cat "$pidfile")"; fi
  done
  sleep 1
  if [ -f "$DIR/started-munged" ] && alive /run/munge/munged.pid; then kill "$(cat /run/munge/munged.pid)"; fi
  # Only a directory this script made (it holds the marker) is removed: PTM_SLURM_DIR may be mistyped.
  if [ -f "$DIR/.ptm-slurm" ]; then rm -rf "$DIR"; fi
}

case "${1:-}" in
  up) need "$@"; up ;;
  down) need "$@"; down ;;
  *) echo "usage: $0 up|down   (env: PTM_SLURM_DIR)" >&2; exit 2 ;;
esac
