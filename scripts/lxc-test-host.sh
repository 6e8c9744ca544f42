#!/usr/bin/env bash
# Real LXC containers that stand in for CT200 in the molecule scenario (and anything else that needs a
# throwaway systemd Debian host reachable over SSH on the lxc bridge).
#
#   scripts/lxc-test-host.sh ensure                       install lxc/debootstrap, start the lxcbr0 bridge
#   scripts/lxc-test-host.sh create NAME PUBKEY [JSON]    create + start NAME, authorize PUBKEY for root;
#                                                         prints {"name":..,"address":..} (and writes JSON)
#   scripts/lxc-test-host.sh destroy NAME                 stop and remove NAME (no error if absent)
#   scripts/lxc-test-host.sh rootfs                       build the cached root filesystem only
#
# REGEN_LXC_EXTRA_CONFIG: lines appended to a new container's config before its first start (e.g. an
# lxc.mount.entry that shares a directory between two containers, as an NFS mount would).
#
# Everything is idempotent. The root filesystem (Debian bookworm from debootstrap, plus python3,
# python3-venv and openssh-server) is built once per machine and kept as a tarball in
# $REGEN_LXC_CACHE (default /var/cache/lxc/regen, next to lxc's own template cache, so a fresh clone
# of the repo on the same machine reuses it); a container is then one tar extraction (~seconds).
# Must run as root: LXC system containers need it.
set -euo pipefail

RELEASE=${REGEN_LXC_RELEASE:-bookworm}
CACHE=${REGEN_LXC_CACHE:-/var/cache/lxc/regen}
LXC_PATH=${REGEN_LXC_PATH:-/var/lib/lxc}
PACKAGES="python3,python3-venv,openssh-server,ca-certificates,iproute2"
# Bump when the recipe below changes, so an old cached rootfs is not reused.
RECIPE=2
ROOTFS_TAR="$CACHE/$RELEASE-amd64-r$RECIPE.tar"
BOOT_TIMEOUT=${REGEN_LXC_BOOT_TIMEOUT:-120}

log() { echo "lxc-test-host: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

need_root() {
  [ "$(id -u)" = 0 ] || die "must run as root (LXC system containers need it); run the tests as root"
}

ensure() {
  need_root
  local missing=()
  command -v lxc-create >/dev/null || missing+=(lxc)
  [ -x /usr/share/lxc/templates/lxc-debian ] || missing+=(lxc-templates)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  command -v rsync >/dev/null || missing+=(rsync)
  command -v dnsmasq >/dev/null || missing+=(dnsmasq-base)
  command -v ssh >/dev/null || missing+=(openssh-client)
  if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || die "no apt-get: install ${missing[*]} by hand"
    log "installing ${missing[*]} (once per machine)"
    # A fresh machine may have no package lists yet.
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || die "apt-get update failed"
    # With recommends: lxc-net needs nftables for its NAT, apparmor for the "generated" profile.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2 \
      || die "apt-get install ${missing[*]} failed"
  fi
  # The bridge with DHCP and NAT: lxc-net is idempotent, but a half-started one (bridge up, no
  # dnsmasq) must be stopped first.
  if ! ip -4 addr show lxcbr0 2>/dev/null | grep -q inet || ! [ -s /run/lxc/dnsmasq.pid ] \
      || ! kill -0 "$(cat /run/lxc/dnsmasq.pid)" 2>/dev/null; then
    /usr/libexec/lxc/lxc-net stop >/dev/null 2>&1 || true
    /usr/libexec/lxc/lxc-net start >&2 || die "lxc-net start failed: no lxcbr0 bridge"
  fi
  ip -4 addr show lxcbr0 | grep -q inet || die "lxcbr0 has no IPv4 address after lxc-net start"
}

rootfs() {
  ensure
  [ -f "$ROOTFS_TAR" ] && return 0
  mkdir -p "$CACHE"
  local builder="regen-rootfs-build-$$"
  log "building the $RELEASE root filesystem (once per machine; about a minute)"
  lxc-destroy -n "$builder" >/dev/null 2>&1 || true
  # The debian template debootstraps into lxc's own cache (/var/cache/lxc/debian) and copies from it.
  lxc-create -n "$builder" -t debian -- -r "$RELEASE" --packages="$PACKAGES" >/dev/null 2>"$CACHE/build.log" \
    || { lxc-destroy -n "$builder" >/dev/null 2>&1 || true; die "lxc-create failed; see $CACHE/build.log"; }
  local root="$LXC_PATH/$builder/rootfs"
  [ -x "$root/usr/bin/python3" ] || { lxc-destroy -n "$builder" || true; die "rootfs lacks python3"; }
  # Nothing machine-specific in the cached image: host keys are made per container at first boot.
  rm -f "$root"/etc/ssh/ssh_host_* "$root"/etc/machine-id
  : > "$root/etc/machine-id"
  cat > "$root/etc/systemd/system/regen-ssh-hostkeys.service" <<'UNIT'
[Unit]
Description=Generate SSH host keys (regen test container)
Before=ssh.service
ConditionPathExists=!/etc/ssh/ssh_host_ed25519_key

[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -A

[Install]
WantedBy=multi-user.target
UNIT
  ln -sf /etc/systemd/system/regen-ssh-hostkeys.service \
    "$root/etc/systemd/system/multi-user.target.wants/regen-ssh-hostkeys.service"
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
  tar --numeric-owner -C "$root" -cf "$ROOTFS_TAR.tmp" . && mv "$ROOTFS_TAR.tmp" "$ROOTFS_TAR"
  lxc-destroy -n "$builder" >/dev/null
  log "cached $ROOTFS_TAR ($(du -h "$ROOTFS_TAR" | cut -f1))"
}

address_of() {
  lxc-info -n "$1" -iH 2>/dev/null | grep -E '^[0-9]+\.' | head -1 || true
}

create() {
  local name=$1 pubkey=$2 json_out=${3:-}
  [[ "$name" =~ ^[a-z0-9][a-z0-9-]{0,40}$ ]] || die "container name '$name' must be lowercase letters, digits, -"
  [ -f "$pubkey" ] || die "public key $pubkey does not exist"
  rootfs
  destroy "$name"
  local dir="$LXC_PATH/$name"
  mkdir -p "$dir/rootfs"
  tar --numeric-owner -C "$dir/rootfs" -xf "$ROOTFS_TAR"
  local mac
  mac=$(printf '00:16:3e:%02x:%02x:%02x' $((RANDOM % 256)) $((RANDOM % 256)) $((RANDOM % 256)))
  cat > "$dir/config" <<CONF
# regen test host, made by scripts/lxc-test-host.sh from $ROOTFS_TAR
lxc.include = /usr/share/lxc/config/debian.common.conf
lxc.arch = amd64
lxc.uts.name = $name
lxc.rootfs.path = dir:$dir/rootfs
lxc.net.0.type = veth
lxc.net.0.link = lxcbr0
lxc.net.0.flags = up
lxc.net.0.hwaddr = $mac
lxc.apparmor.profile = generated
lxc.apparmor.allow_nesting = 1
lxc.tty.max = 4
lxc.pty.max = 1024
CONF
  [ -z "${REGEN_LXC_EXTRA_CONFIG:-}" ] || printf '%s\n' "$REGEN_LXC_EXTRA_CONFIG" >> "$dir/config"
  echo "$name" > "$dir/rootfs/etc/hostname"
  printf '127.0.0.1 localhost\n127.0.1.1 %s\n' "$name" > "$dir/rootfs/etc/hosts"
  install -d -m 700 "$dir/rootfs/root/.ssh"
  install -m 600 "$pubkey" "$dir/rootfs/root/.ssh/authorized_keys"
  lxc-start -n "$name" || die "lxc-start $name failed (lxc-start -n $name -F -l DEBUG shows why)"
  local deadline=$((SECONDS + BOOT_TIMEOUT)) address="" state=""
  while [ $SECONDS -lt $deadline ]; do
    address=$(address_of "$name")
    state=$(lxc-attach -n "$name" -- systemctl is-system-running 2>/dev/null || true)
    if [ -n "$address" ] && { [ "$state" = running ] || [ "$state" = degraded ]; } \
        && lxc-attach -n "$name" -- systemctl is-active --quiet ssh 2>/dev/null; then
      break
    fi
    sleep 1
  done
  [ -n "$address" ] || die "$name got no address on lxcbr0 within ${BOOT_TIMEOUT}s"
  [ "$state" = running ] || [ "$state" = degraded ] || die "$name: systemd is '$state' after ${BOOT_TIMEOUT}s"
  local doc
  doc=$(printf '{"name": "%s", "address": "%s", "systemd": "%s"}' "$name" "$address" "$state")
  [ -z "$json_out" ] || echo "$doc" > "$json_out"
  echo "$doc"
}

destroy() {
  local name=$1
  if lxc-info -n "$name" >/dev/null 2>&1; then
    lxc-stop -n "$name" -k >/dev/null 2>&1 || true
    lxc-destroy -n "$name" >/dev/null 2>&1 || rm -rf "${LXC_PATH:?}/$name"
  elif [ -d "$LXC_PATH/$name" ]; then
    rm -rf "${LXC_PATH:?}/$name"
  fi
}

cmd=${1:-}
case "$cmd" in
  ensure) ensure ;;
  rootfs) rootfs ;;
  create) [ $# -ge 3 ] || die "usage: $0 create NAME PUBKEY [JSON]"; create "$2" "$3" "${4:-}" ;;
  destroy) [ $# -ge 2 ] || die "usage: $0 destroy NAME"; need_root; destroy "$2" ;;
  address) address_of "$2" ;;
  *) die "usage: $0 ensure|rootfs|create NAME PUBKEY [JSON]|destroy NAME|address NAME" ;;
esac
