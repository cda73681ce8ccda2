#!/usr/bin/env bash
# Installs what slime's build needs on a fresh Debian 12 (bookworm) machine:
# cmake >= 3.31 and Catch2 v3 from bookworm-backports, the rest from bookworm.
# `--fuzz` adds clang and its libFuzzer/sanitizer runtimes (tools/fuzz.sh).
# Idempotent: a second run installs nothing. On any other system (e.g. the
# Ubuntu 24.04 GPU machine, which has its own cmake 4 / Catch2 3.4 / benchmark)
# it only reports what it finds and changes nothing.
set -euo pipefail

need_cmake="3.28"   # first cmake we rely on for CUDA + C++20 (bookworm's 3.25 cannot)
pkgs_backports=(cmake catch2)
pkgs_main=(ninja-build libbenchmark-dev nlohmann-json3-dev libcli11-dev libfmt-dev python3 libpng-dev libjpeg62-turbo-dev)
if [ "${1:-}" = "--fuzz" ]; then
  pkgs_main+=(clang libclang-rt-14-dev)
fi

version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

have_cmake() {
  command -v cmake >/dev/null 2>&1 || return 1
  local v; v=$(cmake --version | head -n1 | awk '{print $3}')
  version_ge "$v" "$need_cmake"
}

have_catch2_v3() {
  [ -f /usr/include/catch2/catch_test_macros.hpp ] || [ -f /usr/local/include/catch2/catch_test_macros.hpp ]
}

. /etc/os-release 2>/dev/null || true
if [ "${ID:-}" != "debian" ] || [ "${VERSION_CODENAME:-}" != "bookworm" ]; then
  echo "install-deps: not Debian bookworm (${PRETTY_NAME:-unknown}); installing nothing."
  have_cmake && echo "  cmake: $(cmake --version | head -n1)" || echo "  cmake >= $need_cmake: NOT FOUND"
  have_catch2_v3 && echo "  Catch2 v3: found" || echo "  Catch2 v3: not found in /usr or /usr/local (CMAKE_PREFIX_PATH may still find it)"
  { [ -f /usr/include/png.h ] && [ -f /usr/include/jpeglib.h ]; } && echo "  libpng, libjpeg: found" \
    || echo "  libpng/libjpeg headers: not found (slime builds without PNG/JPEG decoding; image tests skip)"
  exit 0
fi

missing=()
have_cmake || missing+=(cmake)
have_catch2_v3 || missing+=(catch2)
for p in "${pkgs_main[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: everything present; nothing to do."
  exit 0
fi
echo "install-deps: installing ${missing[*]}"

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

# Derive the backports source from the machine's own Debian source: same URI and
# keyring, suite bookworm-backports. Handles deb822 (.sources) and one-line lists.
backports_list=/etc/apt/sources.list.d/slime-bookworm-backports.list
if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
  uri=""; keyring=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    # First stanza whose Suites has plain 'bookworm'.
    read -r uri keyring < <(awk '
      /^[[:space:]]*$/ { if (s ~ /(^| )bookworm( |$)/ && u != "") { print u, k; exit } u=""; s=""; k="" ; next }
      /^URIs:/ { u=$2 } /^Suites:/ { $1=""; s=$0 } /^Signed-By:/ { k=$2 }
      END { if (s ~ /(^| )bookworm( |$)/ && u != "") print u, k }' /etc/apt/sources.list.d/debian.sources) || true
  fi
  if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri=$(awk '$1=="deb" && $0 ~ / bookworm / { for (i=2;i<=NF;i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' /etc/apt/sources.list)
  fi
  if [ -z "$uri" ]; then
    echo "install-deps: cannot find this machine's Debian bookworm apt source to derive backports from" >&2
    exit 1
  fi
  opt=""
  [ -n "$keyring" ] && opt="[signed-by=$keyring] "
  echo "deb ${opt}${uri} bookworm-backports main" | $SUDO tee "$backports_list" >/dev/null
  echo "install-deps: added $backports_list ($uri bookworm-backports)"
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# Catch2 v3 and cmake 3.31 come from backports; the rest from bookworm. Never
# libcub-dev / libthrust-dev: they would shadow the CUDA toolkit's CCCL.
$SUDO apt-get install -y -qq --no-install-recommends -t bookworm-backports "${pkgs_backports[@]}"
$SUDO apt-get install -y -qq --no-install-recommends "${pkgs_main[@]}"
have_cmake || { echo "install-deps: cmake >= $need_cmake still missing" >&2; exit 1; }
have_catch2_v3 || { echo "install-deps: Catch2 v3 still missing" >&2; exit 1; }
echo "install-deps: done ($(cmake --version | head -n1))"
