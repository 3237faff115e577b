#!/usr/bin/env bash
# The CPython interpreters the stack tests need beyond pyenv's 3.10-3.13: 3.14 and 3.15, each as the
# default (GIL) build and the free-threaded one (--disable-gil). Built from Debian's upstream source
# tarballs (the .orig.tar.xz of source packages python3.14 / python3.15), fetched from the Debian mirror
# this host's apt already uses, checked against the SHA-256 below, and built in place (no `make install`:
# the tests run ./python from the build tree). Nothing here is used by `make run`.
#
# Where: $KVTRACE_PYTHONS (default /var/cache/kvtrace/pythons), one folder per build, each with a stamp
# written only after its interpreter ran: a later call skips what is built (a second or two), and an
# interrupted build is redone. Two to six minutes a build on two cores (bench/RESULTS.md §P).
#
# Then pytest, the version the project's .venv has, for these and pyenv's interpreters (pure Python, installed
# with the .venv's pip into $KVTRACE_PYTHONS/pytest-VERSION, with what it needs on 3.10 too), so that the code that runs inside a traced
# program (the vLLM plugin, `kvtrace run`'s tracer) is tested by each of them: tests/unit/test_builds_in_process.py.
#
# Why these releases: they are the newest whose source the mirror serves (the newer ones listed in its
# indexes answer 404); the probes check every offset they use against the interpreter's own
# _Py_DebugOffsets, so a patch release that moved a field would fail closed, not give wrong stacks.
set -euo pipefail

ROOT=${KVTRACE_PYTHONS:-/var/cache/kvtrace/pythons}
# label  source package  upstream version  tarball SHA-256  configure flags
BUILDS=(
  "3.14.7  python3.14 3.14.7     3b48dac8fb59f62eaa67ac83c1eb12bda1b7a08406dd286e252c11a66be27f81 "
  "3.14.7t python3.14 3.14.7     3b48dac8fb59f62eaa67ac83c1eb12bda1b7a08406dd286e252c11a66be27f81 --disable-gil"
  "3.15.0rc1  python3.15 3.15.0~rc1 f84dad680ab2147417d2739355c2678f0f9acffe4ae8ef77895de1454b384b07 "
  "3.15.0rc1t python3.15 3.15.0~rc1 f84dad680ab2147417d2739355c2678f0f9acffe4ae8ef77895de1454b384b07 --disable-gil"
)

say() { echo "pythons: $*"; }

need_packages() {
  local missing=() package
  for package in gcc make pkg-config libffi-dev zlib1g-dev curl xz-utils; do
    dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
  done
  if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

# The Debian mirror apt already uses (its main archive, not the security one).
debian_mirror() {
  apt-cache policy 2>/dev/null | awk '$2 ~ /^https?:/ && $3 ~ /\/main$/ && $2 !~ /security/ {print $2; exit}'
}

fetch_source() { # package version sha256 -> path of the verified tarball
  local package=$1 version=$2 sha=$3
  local tarball="$ROOT/src/${package}_${version}.orig.tar.xz"
  if [[ -f $tarball ]] && echo "$sha  $tarball" | sha256sum -c --status; then
    echo "$tarball"; return
  fi
  local mirror; mirror=$(debian_mirror)
  if [[ -z $mirror ]]; then
    say "no Debian mirror in apt's sources (apt-cache policy lists none): add one, run apt-get update, and retry" >&2
    exit 1
  fi
  mkdir -p "$ROOT/src"
  local url="$mirror/pool/main/p/$package/${package}_${version}.orig.tar.xz"
  say "fetching ${package}_${version}.orig.tar.xz ($url)" >&2
  curl -fsS --retry 3 --max-time 600 -o "$tarball.part" "$url" || {
    say "could not fetch $url: the interpreter tests of $package need it" >&2; exit 1; }
  if ! echo "$sha  $tarball.part" | sha256sum -c --status; then
    say "$url does not have the SHA-256 kvtrace pinned ($sha): refusing it" >&2
    rm -f "$tarball.part"; exit 1
  fi
  mv "$tarball.part" "$tarball"
  echo "$tarball"
}

build() { # label package version sha256 [configure flags]
  local label=$1 package=$2 version=$3 sha=$4; shift 4
  local dir="$ROOT/$label" stamp="$ROOT/$label/.kvtrace-built"
  local want="$version $sha $*"
  if [[ -f $stamp && $(cat "$stamp") == "$want" && -x $dir/python ]]; then
    return
  fi
  need_packages
  local tarball; tarball=$(fetch_source "$package" "$version" "$sha")
  say "building CPython $label (two to six minutes on two cores; log: $dir/build.log)"
  local started=$SECONDS
  rm -rf "$dir" && mkdir -p "$dir"
  tar xJf "$tarball" -C "$dir" --strip-components=1
  (
    cd "$dir"
    ./configure --without-ensurepip --disable-test-modules "$@" > build.log 2>&1
    make -j"$(nproc)" >> build.log 2>&1
  ) || { tail -20 "$dir/build.log"; say "building $label failed: see $dir/build.log" >&2; exit 1; }
  local gil=True; [[ " $* " == *" --disable-gil "* ]] && gil=False
  local check="import ctypes, sys; assert sys.version.startswith('${version/\~/}'), sys.version"
  check+="; assert str(getattr(sys, '_is_gil_enabled', lambda: True)()) == '$gil', 'GIL state'"
  "$dir/python" -c "$check" || { say "the built $label does not run as expected" >&2; exit 1; }
  echo "$want" > "$stamp"
  say "built $label in $((SECONDS - started)) s"
}

for line in "${BUILDS[@]}"; do
  # shellcheck disable=SC2086  # the configure flags are words
  build $line
done

VENV_PYTHON=${KVTRACE_VENV_PYTHON:-.venv/bin/python}
if [[ -x $VENV_PYTHON ]]; then
  version=$("$VENV_PYTHON" -c 'import pytest; print(pytest.__version__)')
  target="$ROOT/pytest-$version"
  if [[ ! -f $target/.kvtrace-built ]]; then
    say "installing pytest $version for the interpreters into $target"
    rm -rf "$target"
    "$VENV_PYTHON" -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
      --target "$target" "pytest==$version" exceptiongroup tomli 2>&1 | grep -v "is ignored: it is neither" >&2 || true
    "$VENV_PYTHON" -c "import sys; sys.path.insert(0, '$target'); import pytest" \
      || { say "pytest $version did not install into $target" >&2; exit 1; }
    touch "$target/.kvtrace-built"
  fi
else
  say "no $VENV_PYTHON: run make setup first (pytest for the interpreters comes from its pip)" >&2
  exit 1
fi
