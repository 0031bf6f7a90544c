#!/usr/bin/env bash
# Test hosts for the multi-node launcher (tests/launcher): PTM_MN_HOSTS (default 2) Linux network
# namespaces ptm-mn1, ptm-mn2, ... joined by a bridge that lives in its own namespace (ptm-mn-sw),
# so the root namespace's network is never touched. Host i has address 10.77.0.i/24 on eth0 and its
# own sshd (key-only auth with a key made here). Everything lives under PTM_MN_DIR.
#
#   scripts/multinode_hosts.sh up     # root; prints the hostfile path on stdout (last line)
#   scripts/multinode_hosts.sh down   # kills every process in those namespaces, deletes them
#
# Both are idempotent. Files in PTM_MN_DIR (default /tmp/ptm-multinode):
#   hostfile     "10.77.0.i slots=PTM_MN_SLOTS" lines (default 2 slots)
#   ssh_config   use with ssh -F / ptm-launch --launcher_args "-F .../ssh_config"
#   namespaces   one namespace name per line, in hostfile order
set -euo pipefail

DIR="${PTM_MN_DIR:-/tmp/ptm-multinode}"
HOSTS="${PTM_MN_HOSTS:-2}"
SLOTS="${PTM_MN_SLOTS:-2}"
PREFIX=ptm-mn
SWITCH="${PREFIX}-sw"
SUBNET=10.77.0
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

host_ns() { echo "${PREFIX}$1"; }

our_namespaces() { ip netns list | awk '{print $1}' | grep -E "^${PREFIX}([0-9]+|-sw)$" || true; }

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
  trap - EXIT
  log "up: $HOSTS hosts (${SUBNET}.1 .. ${SUBNET}.$HOSTS), $SLOTS slots each"
  echo "$DIR/hostfile"
}

case "${1:-}" in
  up) need_root "$@"; up ;;
  down) need_root "$@"; down ;;
  *) echo "usage: $0 up|down   (env: PTM_MN_DIR, PTM_MN_HOSTS, PTM_MN_SLOTS)" >&2; exit 2 ;;
esac
