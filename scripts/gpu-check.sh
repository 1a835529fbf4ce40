#!/usr/bin/env bash
# The GPU check (issue 38), one command on a machine with an NVIDIA GPU, nvcc, CMake and its
# own Python 3.12, and no network:
#
#   scripts/gpu-check-prepare.sh   # first, where PyPI is reachable: fills .gpu-check/
#   scripts/gpu-check.sh           # then, on the GPU machine (.gpu-check/ travels with the tree)
#
# It installs Blazar's Python dependencies from the wheels in .gpu-check/wheels (beside what
# the machine's Python already has), builds the cuda flavour of the pinned llama-server for
# the local GPU only from the trimmed source in .gpu-check/ (the build lane, sha256 checked),
# then runs scripts/gpu_check.py: three models at once, planned vs measured VRAM, decode
# tokens/s GPU vs CPU, an eviction, the 503 for a model that cannot fit. The report goes to
# bench/results/gpu-<UTC time>.txt and to $OUT when that is set. Exit 0: every check passed.
#
# GPU_CHECK_ENGINE=/path/to/llama-server skips the build; PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
kit=.gpu-check
py="${PYTHON:-python3}"
if [ ! -f "$kit/SOURCE" ]; then
  echo "gpu-check: $kit/SOURCE is missing: run scripts/gpu-check-prepare.sh first, where PyPI is reachable" >&2
  exit 1
fi
work="${GPU_CHECK_WORK:-/tmp/blazar-gpu-check}"
mkdir -p "$work"
echo "== Python deps from $kit/wheels into $work/site"
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" "$kit"/wheels/*.whl
export PYTHONPATH="$work/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${GPU_CHECK_ENGINE:-}" ]; then
  read -r sdist sha < "$kit/SOURCE"
  echo "== building llama-server (the build lane picks the flavour; a GPU means cuda)"
  start=$(date +%s)
  GPU_CHECK_ENGINE="$(BLAZAR_ENGINE_SDIST="$kit/$sdist" BLAZAR_ENGINE_SDIST_SHA256="$sha" \
    BLAZAR_ENGINE_HOME="$work/engines" "$py" -m blazar.engines.build | tail -n 1)"
  echo "== built in $(( $(date +%s) - start )) s: $GPU_CHECK_ENGINE"
fi
report="bench/results/gpu-$(date -u +%Y-%m-%dT%H%M%SZ).txt"
set +e
PYTHONUNBUFFERED=1 "$py" scripts/gpu_check.py --engine "$GPU_CHECK_ENGINE" --out "$report"
code=$?
set -e
if [ -n "${OUT:-}" ] && [ -f "$report" ]; then cp "$report" "$OUT/"; fi
exit $code
