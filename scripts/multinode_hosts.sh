#!/usr/bin/env bash
# Test hosts for the multi-node launcher (tests/launcher) and the emulated cluster (benchmarks/cluster):
# PTM_MN_HOSTS (default 2) Linux network namespaces ptm-mn1, ptm-mn2, ... joined by a bridge that lives
# in its own namespace (ptm-mn-sw), so the root namespace's network is never touched. Host i has address
# 10.77.0.i/24 on eth0 and its own sshd (key-only auth with a key made here). Everything lives under
# PTM_MN_DIR.
#
#   scripts/multinode_hosts.sh up     # root; prints the hostfile path on stdout (last line)
#   scripts/multinode_hosts.sh shape  # (re)applies the PTM_MN_INTER_* / PTM_MN_INTRA_* shaping to hosts that are up
#   scripts/multinode_hosts.sh down   # kills every process in those namespaces, deletes them
#
# All are idempotent; up applies the shaping too. Files in PTM_MN_DIR (default /tmp/ptm-multinode):
#   hostfile     "10.77.0.i slots=PTM_MN_SLOTS" lines (default 2 slots)
#   ssh_config   use with ssh -F / ptm-launch --launcher_args "-F .../ssh_config"
#   namespaces   one namespace name per line, in hostfile order
#   shaping      key=value lines: the shaping in force (rates in bit/s, delays in us, delay_applied 0/1)
#
# Shaping, per direction (unset or 0: none); rates in bit/s, delays in microseconds:
#   PTM_MN_INTER_RATE, PTM_MN_INTER_DELAY  each host's link to the switch: egress of the host's eth0
#                                          (host -> switch) and of its switch port (switch -> host)
#   PTM_MN_INTRA_RATE, PTM_MN_INTRA_DELAY  each host's lo: what the host's processes send one another
#   PTM_MN_DELAY_MISSING=ignore            shape the rates only where the kernel has no netem qdisc
#                                          (shaping then says delay_applied=0); default: an error
# PTM_MN_PREFIX (namespace names, default ptm-mn) and PTM_MN_SUBNET (first three octets, default 10.77.0)
# let two sets of hosts exist at once.
set -euo pipefail

DIR="${PTM_MN_DIR:-/tmp/ptm-multinode}"
HOSTS="${PTM_MN_HOSTS:-2}"
SLOTS="${PTM_MN_SLOTS:-2}"
PREFIX="${PTM_MN_PREFIX:-ptm-mn}"
SWITCH="${PREFIX}-sw"
SUBNET="${PTM_MN_SUBNET:-10.77.0}"
INTER_RATE="${PTM_MN_INTER_RATE:-0}"
INTER_DELAY="${PTM_MN_INTER_DELAY:-0}"
INTRA_RATE="${PTM_MN_INTRA_RATE:-0}"
INTRA_DELAY="${PTM_MN_INTRA_DELAY:-0}"
DELAY_MISSING="${PTM_MN_DELAY_MISSING:-error}"
SSHD=/usr/sbin/sshd  # sshd must be started by absolute path (it re-executes itself)

log() { echo "[multinode_hosts] $*" >&2; }
die() { log "error: $*"; exit 1; }

need_root() {
  [ "$(id -u)" = 0 ] || die "must run as root (it creates network namespaces and starts sshd); try: sudo $0 $*"
  command -v ip >/dev/null 2>&1 || install_pkgs iproute2
  ip netns list >/dev/null 2>&1 || die "'ip netns' does not work here (no network-namespace support)"
}

install_pkgs() {
  log "installing missing Debian packages: $*"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2; then
    apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2
  fi
}

check_settings() {
  [[ "$HOSTS" =~ ^[1-9][0-9]?$ ]] || die "PTM_MN_HOSTS=$HOSTS: give a number of hosts from 1 to 99"
  [[ "$SLOTS" =~ ^[1-9][0-9]*$ ]] || die "PTM_MN_SLOTS=$SLOTS: give a positive number of slots per host"
  [[ "$PREFIX" =~ ^[a-z][a-z0-9-]{0,11}$ ]] \
    || die "PTM_MN_PREFIX=$PREFIX: use 1 to 12 of a-z, 0-9 and -, starting with a letter"
  [[ "$SUBNET" =~ ^10\.[0-9]{1,3}\.[0-9]{1,3}$ ]] \
    || die "PTM_MN_SUBNET=$SUBNET: give the first three octets of a /24 inside 10.0.0.0/8, e.g. 10.77.0"
  local v
  for v in INTER_RATE INTER_DELAY INTRA_RATE INTRA_DELAY; do
    [[ "${!v}" =~ ^[0-9]+$ ]] || die "PTM_MN_$v=${!v}: give a whole number (rates in bit/s, delays in microseconds)"
  done
  [[ "$DELAY_MISSING" =~ ^(error|ignore)$ ]] || die "PTM_MN_DELAY_MISSING=$DELAY_MISSING: give error or ignore"
}

host_ns() { echo "${PREFIX}$1"; }

our_namespaces() { ip netns list | awk '{print $1}' | grep -E "^${PREFIX}([0-9]+|-sw|-probe)$" || true; }

down() {
  local ns pids
  for ns in $(our_namespaces); do
    pids="$(ip netns pids "$ns" || true)"
    if [ -n "$pids" ]; then
      # shellcheck disable=SC2086  # word splitting of the pid list is intended
      kill -TERM $pids 2>/dev/null || true
      sleep 0.5
      pids="$(ip netns pids "$ns" || true)"
      # shellcheck disable=SC2086
      [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
    fi
    ip netns del "$ns"
    log "deleted namespace $ns"
  done
  # Only a directory this script made (it holds the marker) is removed: PTM_MN_DIR may be mistyped.
  if [ -f "$DIR/.ptm-multinode" ]; then rm -rf "$DIR"; fi
}

sshd_alive() {
  local pidfile="$DIR/sshd-$1.pid"
  [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}

all_up() {
  local i
  [ -f "$DIR/hostfile" ] && [ -f "$DIR/ssh_config" ] || return 1
  [ "$(grep -c "^[^#].*slots=" "$DIR/hostfile")" = "$HOSTS" ] || return 1
  [ "$(grep -c "^${SUBNET}\.[0-9]* slots=${SLOTS}$" "$DIR/hostfile")" = "$HOSTS" ] || return 1
  for i in $(seq 1 "$HOSTS"); do
    ip netns list | awk '{print $1}' | grep -qx "$(host_ns "$i")" || return 1
    sshd_alive "$i" || return 1
  done
}

write_sshd_config() {
  local i=$1
  cat > "$DIR/sshd_config-$i" <<EOF
ListenAddress ${SUBNET}.$i
Port 22
HostKey $DIR/ssh_host_ed25519_key
PidFile $DIR/sshd-$i.pid
AuthorizedKeysFile $DIR/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
X11Forwarding no
AllowTcpForwarding no
MaxStartups 100:30:200
LogLevel INFO
EOF
}

up() {
  if ! command -v ssh >/dev/null 2>&1 || [ ! -x "$SSHD" ]; then install_pkgs openssh-server openssh-client; fi
  if ! command -v pdsh >/dev/null 2>&1; then install_pkgs pdsh; fi
  if all_up; then
    log "already up"
    shape
    echo "$DIR/hostfile"
    return 0
  fi
  down
  [ ! -e "$DIR" ] || die "$DIR exists but was not made by this script; remove it or set PTM_MN_DIR"
  # Any failure from here on (set -e or die) leaves nothing behind.
  trap 'log "set-up failed; tearing down"; down' EXIT
  mkdir -p "$DIR"
  chmod 700 "$DIR"
  touch "$DIR/.ptm-multinode"
  mkdir -p /run/sshd  # sshd's privilege-separation directory
  ssh-keygen -q -t ed25519 -N '' -C ptm-multinode-test -f "$DIR/id_ed25519"
  ssh-keygen -q -t ed25519 -N '' -C ptm-multinode-host -f "$DIR/ssh_host_ed25519_key"
  cp "$DIR/id_ed25519.pub" "$DIR/authorized_keys"

  ip netns add "$SWITCH"
  ip -n "$SWITCH" link add br0 type bridge
  ip -n "$SWITCH" link set br0 up
  local i ns
  : > "$DIR/namespaces"
  {
    echo "# test hosts made by scripts/multinode_hosts.sh: hostname slots=N"
    for i in $(seq 1 "$HOSTS"); do echo "${SUBNET}.$i slots=$SLOTS"; done
  } > "$DIR/hostfile"
  for i in $(seq 1 "$HOSTS"); do
    ns="$(host_ns "$i")"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # Both veth ends are created inside namespaces: the root namespace gets no new link.
    ip -n "$ns" link add eth0 type veth peer name "v$i" netns "$SWITCH"
    ip -n "$SWITCH" link set "v$i" master br0 up
    ip -n "$ns" addr add "${SUBNET}.$i/24" dev eth0
    ip -n "$ns" link set eth0 up
    write_sshd_config "$i"
    ip netns exec "$ns" "$SSHD" -f "$DIR/sshd_config-$i" -E "$DIR/sshd-$i.log"
    echo "$ns" >> "$DIR/namespaces"
  done
  cat > "$DIR/ssh_config" <<EOF
Host ${SUBNET}.*
  User root
  Port 22
  IdentityFile $DIR/id_ed25519
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  BatchMode yes
  ConnectTimeout 10
  LogLevel ERROR
EOF
  # Every host must reach every host's sshd before anyone uses the hostfile.
  local j tries
  for i in $(seq 1 "$HOSTS"); do
    for j in $(seq 1 "$HOSTS"); do
      tries=0
      until ip netns exec "$(host_ns "$i")" ssh -F "$DIR/ssh_config" "${SUBNET}.$j" true; do
        tries=$((tries + 1))
        [ "$tries" -lt 50 ] || die "ssh ${SUBNET}.$i -> ${SUBNET}.$j fails; see $DIR/sshd-$j.log"
        sleep 0.1
      done
    done
  done
  shape
  trap - EXIT
  log "up: $HOSTS hosts (${SUBNET}.1 .. ${SUBNET}.$HOSTS), $SLOTS slots each"
  echo "$DIR/hostfile"
}

netem_available() {
  # tried in a namespace of its own: some kernels are built without the netem qdisc
  local probe="${PREFIX}-probe" ok=1
  ip netns del "$probe" 2>/dev/null || true
  ip netns add "$probe"
  ip netns exec "$probe" tc qdisc add dev lo root netem delay 1us 2>/dev/null || ok=0
  ip netns del "$probe"
  [ "$ok" = 1 ]
}

# shape_dev NS DEV RATE DELAY: limit DEV's egress in NS to RATE bit/s and delay it by DELAY us (0: that part
# is left out), replacing any earlier shaping. htb rather than tbf: a packet larger than the bucket borrows
# instead of being dropped, and veth and lo pass 64 KiB GSO packets. netem delays below the rate limit.
shape_dev() {
  local ns=$1 dev=$2 rate=$3 delay=$4
  ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
  [ "$DELAY_APPLIED" = 1 ] || delay=0
  if [ "$rate" -gt 0 ]; then
    ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: htb default 1
    ip netns exec "$ns" tc class add dev "$dev" parent 1: classid 1:1 htb rate "${rate}bit" ceil "${rate}bit" \
      quantum 1514
    if [ "$delay" -gt 0 ]; then
      ip netns exec "$ns" tc qdisc add dev "$dev" parent 1:1 handle 10: netem delay "${delay}us" limit 100000
    else  # a long queue: a slow link makes senders wait, it does not drop their packets
      ip netns exec "$ns" tc qdisc add dev "$dev" parent 1:1 handle 10: pfifo limit 100000
    fi
  elif [ "$delay" -gt 0 ]; then
    ip netns exec "$ns" tc qdisc add dev "$dev" root netem delay "${delay}us" limit 100000
  fi
}

shape() {
  all_up || die "the hosts are not up (PTM_MN_HOSTS=$HOSTS, PTM_MN_SLOTS=$SLOTS, PTM_MN_DIR=$DIR); run: $0 up"
  DELAY_APPLIED=1
  if [ "$INTER_DELAY" -gt 0 ] || [ "$INTRA_DELAY" -gt 0 ]; then
    if ! netem_available; then
      [ "$DELAY_MISSING" = ignore ] || die "this kernel has no netem qdisc, so PTM_MN_INTER_DELAY=$INTER_DELAY and" \
        "PTM_MN_INTRA_DELAY=$INTRA_DELAY (us) cannot be applied; set them to 0, or PTM_MN_DELAY_MISSING=ignore"
      log "warning: this kernel has no netem qdisc: the delays are not applied, only the rates"
      DELAY_APPLIED=0
    fi
  fi
  local i
  for i in $(seq 1 "$HOSTS"); do
    shape_dev "$(host_ns "$i")" eth0 "$INTER_RATE" "$INTER_DELAY"
    shape_dev "$SWITCH" "v$i" "$INTER_RATE" "$INTER_DELAY"
    shape_dev "$(host_ns "$i")" lo "$INTRA_RATE" "$INTRA_DELAY"
  done
  printf '%s\n' "inter_rate_bps=$INTER_RATE" "inter_delay_us=$INTER_DELAY" "intra_rate_bps=$INTRA_RATE" \
    "intra_delay_us=$INTRA_DELAY" "delay_applied=$DELAY_APPLIED" > "$DIR/shaping"
  log "shaping per direction: inter-host $INTER_RATE bit/s + $INTER_DELAY us, intra-host $INTRA_RATE bit/s +" \
    "$INTRA_DELAY us (delays applied: $DELAY_APPLIED)"
}

case "${1:-}" in
  up) check_settings; need_root "$@"; up ;;
  shape) check_settings; need_root "$@"; shape ;;
  down) check_settings; need_root "$@"; down ;;
  *) echo "usage: $0 up|shape|down   (env: PTM_MN_DIR, PTM_MN_HOSTS, PTM_MN_SLOTS, PTM_MN_PREFIX, PTM_MN_SUBNET," \
       "PTM_MN_INTER_RATE, PTM_MN_INTER_DELAY, PTM_MN_INTRA_RATE, PTM_MN_INTRA_DELAY, PTM_MN_DELAY_MISSING)" >&2
     exit 2 ;;
esac
