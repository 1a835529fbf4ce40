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
in), counts the requests the daemon saw for each run (from its audit log), the
prompt tokens the engine evaluated (a second turn whose prompt extends the
first's byte for byte evaluates only what is new) and the tool calls the agent
ran, and prints a table that also goes to `bench/results/clients-<UTC time>.json`.
A run passes when the agent exits 0 and every generation request it made was
answered 2xx. The script exits 1 if any run fails, after printing the tail of
that client's output and of the daemon's log.

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
        [
            npm,
            "install",
            "--prefix",
            str(tmp),
            "--no-fund",
            "--no-audit",
            "--loglevel=error",
            f"{agent.package}@{agent.version}",
        ],
        capture_output=True,
        text=True,
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
    # Claude Code's native binary is put in place by its postinstall script
    # (copied from @anthropic-ai/claude-code-<platform>): an npm that skips
    # install scripts leaves a stub that cannot run
    check = subprocess.run(
        [str(agent.executable), "--version"], capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    if check.returncode != 0 or agent.version not in check.stdout:
        shutil.rmtree(agent.prefix, ignore_errors=True)
        raise SystemExit(
            f"[clients] {agent.executable} --version did not print {agent.version} "
            f"(exit {check.returncode}): {check.stdout[-500:]}{check.stderr[-1500:]}\n"
            "if npm skipped the package's install script, allow it (npm's allow-scripts / "
            "ignore-scripts settings) and run again"
        )
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
    (config_dir / "settings.json").write_text(
        json.dumps(
            {
                "autoUpdates": False,
                "includeCoAuthoredBy": False,
                "env": {},
            }
        )
    )
    return config_dir


def claude_environment(home: Path, base_url: str, api_key: str) -> dict[str, str]:
    """
    Claude Code's environment: every model it may pick (main, small/fast,
    haiku/sonnet/opus aliases) is C{tiny} on C{base_url}, and nonessential
    traffic (telemetry, error reports, update checks, surveys) is off.
    """
    config_dir = claude_home(home, api_key)
    env = base_environment(home)
    env.update(
        {
            "CLAUDE_CONFIG_DIR": str(config_dir),
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": api_key,
            "ANTHROPIC_MODEL": MODEL,
            "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
            "CLAUDE_CODE_SUBAGENT_MODEL": MODEL,
            # an id it does not know is "assumed to be 1m tokens": compact
            # before the model's real context runs out
            "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(CONTEXT),
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
        }
    )
    return env


def codex_config(base_url: str) -> str:
    """
    Codex's C{config.toml}: Blazar as the one model provider, over the
    Responses API, with update checks, analytics, feedback and the plugin
    sync off.
    """
    return (
        f'model = "{MODEL}"\n'
        'model_provider = "blazar"\n'
        f"model_context_window = {CONTEXT}\n"
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
        "\n"
        # the plugins feature syncs a curated plugin list at start: DNS for
        # github.com, api.github.com and chatgpt.com (seen with strace); off,
        # the agent's only connections are to base_url
        "[features]\n"
        "plugins = false\n"
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
    env.update(
        {
            "CODEX_HOME": str(codex_home),
            "BLAZAR_API_KEY": api_key,
            "RUST_LOG": "warn",
        }
    )
    return env


# -- the conformance run -------------------------------------------------------


@dataclass
class Run:
    """
    One agent invocation and what the daemon saw of it.
    """

    agent: Agent
    turn: int
    argv: list[str]
    exit_code: int | None = None
    seconds: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    tool_calls: list[str] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)

    @property
    def generations(self) -> list[dict[str, Any]]:
        path = "/v1/messages" if self.agent.surface == "anthropic" else "/v1/responses"
        return [r for r in self.requests if r.get("method") == "POST" and r.get("path") == path]

    @property
    def passed(self) -> bool:
        return (
            self.exit_code == 0
            and bool(self.generations)
            and all(200 <= int(r.get("status", 0)) < 300 for r in self.generations)
        )

    def row(self) -> dict[str, Any]:
        seen: dict[str, int] = {}
        for r in self.requests:
            what = f"{r.get('method')} {r.get('path')} {r.get('status')}"
            seen[what] = seen.get(what, 0) + 1
        return {
            "client": self.agent.name,
            "version": self.agent.version,
            "surface": self.agent.surface,
            "turn": self.turn,
            "command": " ".join([self.agent.command, *self.argv[1:]]),
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
            "seconds": round(self.seconds, 1),
            "requests_seen": len(self.requests),
            "requests": seen,
            "tool_calls": self.tool_calls,
            "prefill_tokens": self.prefill_tokens,
            "passed": self.passed,
            "stdout_tail": self.stdout[-400:],
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_engine(explicit: str | None) -> str:
    """
    The llama-server to serve with: C{--engine}, C{$BLAZAR_ENGINE} (set by
    ./dev.sh), else the daemon's own search.
    """
    if explicit or os.environ.get("BLAZAR_ENGINE"):
        return explicit or os.environ["BLAZAR_ENGINE"]
    from blazar.config import parse_config
    from blazar.engines.llamacpp import EngineNotFound, find_binary

    try:
        return str(find_binary(parse_config(""), os.environ))
    except EngineNotFound as e:
        raise SystemExit(f"[clients] no llama-server: run ./dev.sh clients ({e})") from None


class Daemon:
    """
    A real `blazar serve` with API keys on, one generated 128k-context model
    (C{tiny}: C{ctx_size = 131072}, C{parallel = 1}) and an audit log the
    run counts requests from.

    Unless C{tool_tokens}, the model's engine never samples the test
    vocabulary's C{<tool_call>} token (C{--logit-bias ID-inf}): the random
    weights emit it every few hundred tokens, and a noise "tool call" left
    unclosed at the end of an answer makes llama-server fail the stream ("The
    model produced output that does not match the expected peg-native
    format"), which the agent reports as an error and exits 1. That is the
    random model's doing, not the request path this run checks.
    """

    def __init__(self, root: Path, engine: str, keys: dict[str, str], tool_tokens: bool = False) -> None:
        from blazar.models.testmodel import make_test_model, vocabulary

        self.root = root
        self.port = free_port()
        self.model = make_test_model(root / "models" / f"{MODEL}.gguf", context_length=CONTEXT)
        self.audit = root / "audit.jsonl"
        self.log_path = root / "daemon.log"
        self.config = root / "config.toml"
        lines = [
            f'listen = "tcp:{self.port}:interface=127.0.0.1"',
            f'data_dir = "{root / "data"}"',
            f'models_dir = "{root / "models"}"',
            f'audit_log = "{self.audit}"',
            "ready_timeout = 300",
            "[engines.llamacpp]",
            f'binary = "{engine}"',
            f"[models.{MODEL}]",
            f"ctx_size = {CONTEXT}",
            "parallel = 1",
        ]
        self.logit_bias: dict[str, str] = {}
        if not tool_tokens:
            self.logit_bias = {str(vocabulary()[0].index("<tool_call>")): "-inf"}
            lines.append(
                "args = ["
                + ", ".join(f'"--logit-bias", "{token}{bias}"' for token, bias in self.logit_bias.items())
                + "]"
            )
        for name, secret in keys.items():
            lines += ["[[keys]]", f'name = "{name}"', f'secret = "{secret}"']
        self.config.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        blazar = Path(sys.executable).parent / "blazar"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(blazar), "serve", "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"[clients] the daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise SystemExit(f"[clients] the daemon did not answer /health in 60 s:\n{self.log_tail()}")

    def audited(self) -> list[dict[str, Any]]:
        """
        Every request the daemon has finished, from its audit log.
        """
        try:
            text = self.audit.read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def _engine_prefills(self) -> list[int]:
        """
        The prompt tokens the engine evaluated for each generation it logged
        (llama-server's C{prompt eval time = ... / N tokens} lines), from the
        model's engine output as C{blazar logs tiny} shows it: those lines
        are not in the daemon's own log.
        """
        blazar = Path(sys.executable).parent / "blazar"
        out = subprocess.run(
            [str(blazar), "logs", "tiny", "-c", str(self.config)], capture_output=True, text=True, timeout=60
        )
        return [int(n) for n in re.findall(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens", out.stdout)]

    def log_size(self) -> int:
        """
        How many generations the engine has logged so far (a mark for
        L{prefills}).
        """
        return len(self._engine_prefills())

    def prefills(self, since: int) -> list[int]:
        """
        The prompt tokens the engine evaluated for each generation after
        mark C{since} (L{log_size}): a turn that extends the last one's
        prompt byte for byte evaluates only what is new.
        """
        return self._engine_prefills()[since:]

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no daemon log)"

    def stop(self) -> None:
        """
        SIGTERM the daemon (it stops its engines), then KILL whatever is left.
        """
        if self.proc is None:
            return
        import psutil

        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass


def transcript_tool_calls(agent: Agent, home: Path) -> dict[str, str]:
    """
    The tool calls in the agent's own session transcripts under C{home}
    (Claude Code: C{.claude/projects/*/*.jsonl} C{tool_use} blocks; Codex:
    C{.codex/sessions/**/rollout-*.jsonl} C{function_call} items), by call id.
    The random-weight model's noise now and then parses as a tool call, which
    the agent then runs and answers with a tool-result request.
    """
    calls: dict[str, str] = {}
    pattern = ".claude/projects/*/*.jsonl" if agent is CLAUDE_CODE else ".codex/sessions/**/*.jsonl"
    for path in home.glob(pattern):
        for line in path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if not isinstance(entry, dict):
                continue
            if agent is CLAUDE_CODE:
                content = (entry.get("message") or {}).get("content") if entry.get("type") == "assistant" else None
                for block in content if isinstance(content, list) else []:
                    if isinstance(block, dict) and block.get("type") == "tool_use":
                        calls[str(block.get("id"))] = str(block.get("name"))
            else:
                item = entry.get("payload") if entry.get("type") == "response_item" else None
                if isinstance(item, dict) and item.get("type") in ("function_call", "custom_tool_call"):
                    calls[str(item.get("call_id"))] = str(item.get("name"))
    return calls


def run_agent(run: Run, daemon: Daemon, cwd: Path, env: dict[str, str], timeout: float) -> None:
    """
    Run one agent invocation to its end (or C{timeout}) and collect the
    requests the daemon logged for it (its key names the agent) and the tool
    calls its transcript gained.
    """
    home = Path(env["HOME"])
    calls_before = transcript_tool_calls(run.agent, home)
    before = len(daemon.audited())
    log_before = daemon.log_size()
    say(f"{run.agent.name} turn {run.turn}: {run.row()['command']}")
    started = time.monotonic()
    try:
        done = subprocess.run(
            run.argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        run.exit_code, run.stdout, run.stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        run.timed_out = True
        run.stdout = (e.stdout or b"").decode("utf-8", "replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        run.stderr = (e.stderr or b"").decode("utf-8", "replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    run.seconds = time.monotonic() - started
    # the audit log is written by a thread of the daemon's: let it catch up
    time.sleep(1.5)
    run.requests = [r for r in daemon.audited()[before:] if r.get("key") == run.agent.name]
    run.prefill_tokens = daemon.prefills(log_before)
    run.tool_calls = [name for call, name in transcript_tool_calls(run.agent, home).items() if call not in calls_before]
    verdict = "ok" if run.passed else "FAILED"
    say(
        f"{run.agent.name} turn {run.turn}: {verdict}, exit {run.exit_code}"
        f"{' (timed out)' if run.timed_out else ''}, {run.seconds:.1f} s, "
        f"{len(run.requests)} requests: {run.row()['requests']}"
        f"; prompt tokens evaluated: {run.prefill_tokens}"
        f"{'; tool calls run: ' + ', '.join(run.tool_calls) if run.tool_calls else ''}"
    )
    if run.stdout.strip():
        print(f"--- {run.agent.name} turn {run.turn} said:\n{run.stdout.strip()[-1500:]}", flush=True)


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'client':<12} {'version':<9} {'surface':<10} {'turn':>4} {'exit':>5} {'seconds':>8} "
        f"{'requests':>8} {'tool calls':>10}  result"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        code = "T/O" if r["timed_out"] else str(r["exit_code"])
        out.append(
            f"{r['client']:<12} {r['version']:<9} {r['surface']:<10} {r['turn']:>4} {code:>5} "
            f"{r['seconds']:>8.1f} {r['requests_seen']:>8} {len(r['tool_calls']):>10}  "
            f"{'ok' if r['passed'] else 'FAILED'}"
        )
    return "\n".join(out)


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "node": subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip(),
    }


def source() -> dict[str, Any]:
    """
    Which Blazar the run served with: the checkout's commit, and whether
    its code had uncommitted changes (L{None}s outside a git checkout).
    """
    import blazar

    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True)
        except OSError:
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--", "blazar", "twisted", "pyproject.toml")
    return {
        "commit": git("rev-parse", "HEAD"),
        "uncommitted_changes": None if status is None else bool(status),
        "package": str(Path(blazar.__file__).parent),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", help="llama-server binary (default: $BLAZAR_ENGINE, else the daemon's search)")
    p.add_argument("--only", choices=[a.name for a in AGENTS], help="run one agent only")
    p.add_argument("--out", type=Path, help="results file (default: bench/results/clients-<UTC time>.json)")
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT, help="seconds per agent run (default %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (homes, daemon log)")
    p.add_argument(
        "--tool-tokens",
        action="store_true",
        help="let the random model sample <tool_call> (its noise then fails a stream now and then)",
    )
    args = p.parse_args()

    agents = [a for a in AGENTS if args.only in (None, a.name)]
    for agent in agents:
        install(agent)
    engine = find_engine(args.engine)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    out = args.out or ROOT / "bench" / "results" / f"clients-{stamp}.json"
    keys = {a.name: f"blz-{a.name}-" + os.urandom(12).hex() for a in agents}

    scratch = Path(tempfile.mkdtemp(prefix="blazar-clients-"))
    daemon = Daemon(scratch / "daemon", engine, keys, tool_tokens=args.tool_tokens)
    say(f"daemon on {daemon.base_url}, model {MODEL} (ctx {CONTEXT}, 1 slot), keys on; scratch {scratch}")
    runs: list[Run] = []
    try:
        daemon.start()
        for agent in agents:
            home = scratch / agent.name / "home"
            cwd = scratch / agent.name / "project"
            cwd.mkdir(parents=True)
            exe = str(agent.executable)
            if agent is CLAUDE_CODE:
                env = claude_environment(home, daemon.base_url, keys[agent.name])
                turns = [
                    [exe, "-p", "say hi", "--model", MODEL],
                    [exe, "-p", "--continue", "say hi again", "--model", MODEL],
                ]
            else:
                env = codex_environment(home, daemon.base_url, keys[agent.name])
                turns = [
                    [exe, "exec", "--skip-git-repo-check", "--color", "never", "say hi"],
                    [exe, "exec", "--skip-git-repo-check", "--color", "never", "resume", "--last", "again"],
                ]
            for turn, argv in enumerate(turns, 1):
                run = Run(agent, turn, argv)
                runs.append(run)
                run_agent(run, daemon, cwd, env, args.timeout)
                if not run.passed:
                    print(
                        f"--- {agent.name} turn {turn} FAILED; its stderr (tail):\n{run.stderr[-3000:]}\n"
                        f"--- its stdout (tail):\n{run.stdout[-1500:]}\n"
                        f"--- the daemon's log (tail):\n{daemon.log_tail()}",
                        flush=True,
                    )
    finally:
        daemon.stop()

    rows = [r.row() for r in runs]
    passed = bool(rows) and all(r["passed"] for r in rows) and len(rows) == 2 * len(agents)
    result = {
        "when": stamp,
        "passed": passed,
        "blazar": source(),
        "machine": machine(),
        "engine": engine,
        "model": {
            "name": MODEL,
            "ctx_size": CONTEXT,
            "parallel": 1,
            "weights": "random (blazar.models.testmodel)",
            "engine_logit_bias": daemon.logit_bias,
        },
        "keys": "on",
        "runs": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows), flush=True)
    print(f"results: {out}", flush=True)
    if args.keep or not passed:
        say(f"scratch directory kept: {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
