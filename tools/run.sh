#!/usr/bin/env bash
# Builds and runs the main example. Extra arguments go to the example
# (try --help). Until the RL trainer lands, the main example is hello_slime.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh >/dev/null
cmake --preset default >/dev/null
cmake --build --preset default --target hello_slime
exec build/default/examples/hello_slime "$@"
