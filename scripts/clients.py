"""
The coding agents' conformance run: Claude Code and Codex CLI, the current npm
releases, through a real Blazar daemon with API keys on and a generated
128k-context model.

Run it with `./dev.sh clients` (which sets up the venv and the engine first).
It installs the two agents into `~/.cache/blazar/clients/` if they are missing
(pinned versions below; `BLAZAR_CLAUDE_CODE_VERSION` / `BLAZAR_CODEX_VERSION`
pick others, `BLAZAR_CLIENTS_HOME` moves the cache), starts the daemon, runs

    claude -p "say hi" --model tiny              then  claude -p --continue "say hi again"
    codex exec --skip-git-repo-check "say hi"    then  codex exec --skip-git-repo-check resume --last "again"

each in a fresh home of its own (nothing of this machine's configuration leaks
in), counts the requests the daemon saw for each run (from its access log), and
prints a table that also goes to `bench/results/clients-<UTC time>.json`. It
exits 1 if any run fails, after printing the tail of that client's output and
of the daemon's log.

Every network access of the agents goes to the daemon: no telemetry, no update
checks, nothing downloaded at run time (Codex's native binary is an npm package
of its own, `@openai/codex@<version>-linux-x64`, installed with it).

This module also holds the agents' setup (install, home, environment), which
`scripts/record_clients.py` shares.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

CLAUDE_CODE_VERSION = os.environ.get("BLAZAR_CLAUDE_CODE_VERSION", "2.1.332")
CODEX_VERSION = os.environ.get("BLAZAR_CODEX_VERSION", "0.171.0")
CLIENTS_HOME = Path(os.environ.get("BLAZAR_CLIENTS_HOME", "~/.cache/blazar/clients")).expanduser()

MODEL = "tiny"
CONTEXT = 131072
# Claude Code's first request is ~88k tokens: minutes of prefill on 2 cores
RUN_TIMEOUT = float(os.environ.get("BLAZAR_CLIENTS_TIMEOUT", "900"))


@dataclass(frozen=True)
class Agent:
    """
    One coding agent as npm ships it.

    @ivar name: Its short name in the results (C{claude-code}, C{codex}).
    @ivar package: The npm package.
    @ivar version: The pinned version.
    @ivar command: The executable the package installs under C{.bin}.
    @ivar surface: The Blazar surface it talks to (the metrics label).
    """

    name: str
    package: str
    version: str
    command: str
    surface: str

    @property
    def prefix(self) -> Path:
        return CLIENTS_HOME / f"{self.name}-{self.version}"

    @property
    def executable(self) -> Path:
        return self.prefix / "node_modules" / ".bin" / self.command


CLAUDE_CODE = Agent("claude-code", "@anthropic-ai/claude-code", CLAUDE_CODE_VERSION, "claude", "anthropic")
CODEX = Agent("codex", "@openai/codex", CODEX_VERSION, "codex", "responses")
AGENTS = (CLAUDE_CODE, CODEX)


def say(message: str) -> None:
    print(f"[clients] {message}", file=sys.stderr, flush=True)


def install(agent: Agent) -> Path:
    """
    Install C{agent} from the npm registry into its own prefix under
    L{CLIENTS_HOME}, unless it is there already; return its executable.

    The install goes to a temporary prefix that is renamed into place, so an
    interrupted one is never mistaken for a finished one.

    @raise SystemExit: npm is missing, or the install failed.
    """
    if agent.executable.exists():
        return agent.executable
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit(
            f"[clients] installing {agent.package}@{agent.version} needs npm (Node.js 18 or later), "
            "which is not on PATH: on Debian/Ubuntu `sudo apt-get install -y nodejs npm`, or see "
            "https://nodejs.org/en/download; the agents are then kept in "
            f"{CLIENTS_HOME} and installed only once"
        )
    CLIENTS_HOME.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{agent.name}-", dir=CLIENTS_HOME))
    say(f"installing {agent.package}@{agent.version} into {agent.prefix}")
    done = subprocess.run(
        [npm, "install", "--prefix", str(tmp), "--no-fund", "--no-audit", "--loglevel=error",
         f"{agent.package}@{agent.version}"],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(
            f"[clients] npm install {agent.package}@{agent.version} failed "
            f"(exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    # npm writes absolute paths nowhere that matters: the prefix can move
    if agent.prefix.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(agent.prefix)
    if not agent.executable.exists():
        raise SystemExit(f"[clients] {agent.package}@{agent.version} installed no {agent.executable}")
    return agent.executable


def base_environment(home: Path) -> dict[str, str]:
    """
    The environment every agent runs in: a fresh C{HOME}, this PATH (for
    node and the shell), and nothing else of this machine's.
    """
    return {
        "HOME": str(home),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "TMPDIR": str(home / "tmp"),
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


def claude_home(home: Path, api_key: str) -> Path:
    """
    Prepare a fresh home for Claude Code: its config with onboarding done
    and the API key approved (so nothing asks a question), and return the
    config directory (C{CLAUDE_CONFIG_DIR}).
    """
    config_dir = home / ".claude"
    config_dir.mkdir(parents=True, exist_ok=True)
    (home / "tmp").mkdir(exist_ok=True)
    state = {
        "hasCompletedOnboarding": True,
        "lastOnboardingVersion": CLAUDE_CODE.version,
        "hasTrustDialogAccepted": True,
        "bypassPermissionsModeAccepted": True,
        "autoUpdates": False,
        "customApiKeyResponses": {"approved": [api_key[-20:]], "rejected": []},
        "numStartups": 1,
    }
    for path in (home / ".claude.json", config_dir / ".claude.json"):
        path.write_text(json.dumps(state))
    (config_dir / "settings.json").write_text(json.dumps({
        "autoUpdates": False,
        "includeCoAuthoredBy": False,
        "env": {},
    }))
    return config_dir


def claude_environment(home: Path, base_url: str, api_key: str) -> dict[str, str]:
    """
    Claude Code's environment: every model it may pick (main, small/fast,
    haiku/sonnet/opus aliases) is C{tiny} on C{base_url}, and nonessential
    traffic (telemetry, error reports, update checks, surveys) is off.
    """
    config_dir = claude_home(home, api_key)
    env = base_environment(home)
    env.update({
        "CLAUDE_CONFIG_DIR": str(config_dir),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        "CLAUDE_CODE_SUBAGENT_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
        # a slow CPU prefill is not a dead server
        "API_TIMEOUT_MS": str(int(RUN_TIMEOUT * 1000)),
        # running as root in a container: allowed, it is a throwaway home
        "IS_SANDBOX": "1",
    })
    return env


def codex_config(base_url: str) -> str:
    """
    Codex's C{config.toml}: Blazar as the one model provider, over the
    Responses API, with update checks, analytics and feedback off.
    """
    return (
        f'model = "{MODEL}"\n'
        'model_provider = "blazar"\n'
        "check_for_update_on_startup = false\n"
        "\n"
        "[model_providers.blazar]\n"
        'name = "Blazar"\n'
        f'base_url = "{base_url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "BLAZAR_API_KEY"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
        f"stream_idle_timeout_ms = {int(RUN_TIMEOUT * 1000)}\n"
        "\n"
        "[analytics]\n"
        "enabled = false\n"
        "\n"
        "[feedback]\n"
        "enabled = false\n"
    )


def codex_environment(home: Path, base_url: str, api_key: str) -> dict[str, str]:
    """
    Codex's environment: a fresh C{CODEX_HOME} holding L{codex_config}, and
    the key in C{BLAZAR_API_KEY}.
    """
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (home / "tmp").mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(codex_config(base_url))
    env = base_environment(home)
    env.update({
        "CODEX_HOME": str(codex_home),
        "BLAZAR_API_KEY": api_key,
        "RUST_LOG": "warn",
    })
    return env
