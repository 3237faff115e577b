#!/usr/bin/env bash
# Prepares a Debian/Ubuntu host (as root) to run kvtrace: bcc from the distribution, kernel headers
# for bcc (with a fallback when no package matches the running kernel), tracefs, and a virtualenv
# that sees the distribution's bcc module. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "setup: $*" >&2; }
die() { echo "setup: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (sudo make setup): installing packages needs it"
command -v apt-get >/dev/null || die "this script knows Debian/Ubuntu (apt-get); install bcc (python3-bpfcc) and kernel headers by hand"

release=$(uname -r)
arch=$(dpkg --print-architecture)
export DEBIAN_FRONTEND=noninteractive

need=()
/usr/bin/python3 -c 'import bcc' 2>/dev/null || need+=(python3-bpfcc bpfcc-tools)
/usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
command -v gcc >/dev/null || need+=(gcc libc6-dev)
command -v make >/dev/null || need+=(make)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi

# bcc compiles the probes against kernel headers at /lib/modules/$release/build.
if [ ! -e "/lib/modules/$release/build/include" ]; then
  apt-get update -qq
  if apt-get install -y -qq "linux-headers-$release" >/dev/null 2>&1; then
    log "installed linux-headers-$release"
  else
    # No package for this kernel (custom or cloud kernels): take the distribution's current headers.
    # The probes only use pt_regs and BPF helpers from them, which are stable across versions.
    meta=linux-headers-$arch
    grep -qi ubuntu /etc/os-release && meta=linux-headers-generic
    log "no linux-headers-$release package; falling back to $meta"
    apt-get install -y -qq "$meta" >/dev/null
    build=$( (ls -d /usr/src/linux-headers-*-"$arch" /usr/src/linux-headers-*-generic 2>/dev/null || true) | sort -V | tail -n 1)
    [ -n "$build" ] || die "no kernel headers found under /usr/src after installing $meta"
    common=${build%-"$arch"}; common=${common%-generic}
    [ -d "$common-common" ] && common=$common-common
    mkdir -p "/lib/modules/$release"
    ln -sfn "$build" "/lib/modules/$release/build"
    [ -d "$common" ] && ln -sfn "$common" "/lib/modules/$release/source"
    log "linked /lib/modules/$release/build -> $build"
  fi
fi

if [ ! -e /sys/kernel/tracing/uprobe_events ] && [ ! -e /sys/kernel/debug/tracing/uprobe_events ]; then
  mount -t tracefs nodev /sys/kernel/tracing || die "cannot mount tracefs on /sys/kernel/tracing"
fi

if [ ! -x .venv/bin/python ]; then
  log "creating .venv (sees the system's bcc module)"
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,lint]"
.venv/bin/python -c 'import bcc, kvtrace' || die "the virtualenv cannot import bcc and kvtrace"
log "ready: .venv/bin/kvtrace"
