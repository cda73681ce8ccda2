#!/usr/bin/env bash
# Builds slime and runs its tests: installs missing dependencies (Debian 12),
# configures with a preset (default: CUDA code compiled when the toolkit
# exists), builds, runs ctest, then installs the package into a scratch prefix
# and builds the consumer project in tests/consumer against it.
#   tools/test.sh [preset]      presets: default, cpu, cuda (CMakePresets.json)
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-default}"

bash tools/install-deps.sh
cmake --preset "$preset"
cmake --build --preset "$preset"
ctest --preset "$preset"

# The installed package must be usable by another project (find_package(slime)).
prefix="build/$preset/install"
rm -rf "$prefix" "build/$preset/consumer"
cmake --install "build/$preset" --prefix "$prefix" >/dev/null
cmake -S tests/consumer -B "build/$preset/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$PWD/$prefix" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "build/$preset/consumer"
"build/$preset/consumer/slime_consumer"
echo "tools/test.sh: all tests passed and the installed package works ($preset preset)"
