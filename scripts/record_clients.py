"""
Record the real requests of Claude Code and Codex CLI into the fixtures under
`tests/fixtures/clients/`.

A small HTTP server stands in for Blazar: it logs every request (method, path,
headers, JSON body) and answers plausibly: Anthropic Messages (SSE or JSON) on
`/v1/messages`, Responses SSE on `/v1/responses`, a model list on `/v1/models`,
a count on `/v1/messages/count_tokens`, 200 on `HEAD /` and `GET /`. Each agent
(installed as `scripts/clients.py` does, in a fresh home with the same
configuration as the conformance run) is run twice:

- first turn: `claude -p "say hi" --model tiny` / `codex exec --skip-git-repo-check
  "say hi"`, answered with text;
- tool-result turn: the first request is answered with a call of the agent's
  shell tool (`echo hi`, allowed non-interactively), so the agent runs it and
  sends a second request carrying the result;
- Claude Code only, its interactive UI in a pseudo-terminal (`say hi` typed,
  then `/exit`): what most users send, with a tool more and fields `-p` leaves
  out (`safeguards`), into `claude-code-interactive-first.json`.

From each run the agent's main request (the one offering tools) is written to
`<agent>-first.json` / `<agent>-tool-result.json` as `{"client", "version",
"method", "path", "headers", "body"}`, with API keys, auth headers and tokens
replaced by "REDACTED". Every request seen is also listed on stderr (and with
`--log FILE`, written there as JSON lines).

    .venv/bin/python scripts/record_clients.py [--only claude-code|codex] [--log FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from clients import (  # noqa: E402
    CLAUDE_CODE,
    CODEX,
    MODEL,
    ROOT,
    Agent,
    claude_environment,
    codex_environment,
    install,
    say,
)

FIXTURES = ROOT / "tests" / "fixtures" / "clients"
API_KEY = "rec-" + "0123456789abcdef" * 2
SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization", "chatgpt-account-id"}
SECRET_WORDS = ("token", "secret", "key", "auth", "password")


def redact_headers(headers: dict[str, str]) -> dict[str, str]:
    """
    The headers with every secret one's value replaced by C{"REDACTED"}:
    auth and key headers, and any whose name mentions a token, key, secret
    or password.
    """
    out = {}
    for name, value in headers.items():
        lower = name.lower()
        if lower in SECRET_HEADERS or any(w in lower for w in SECRET_WORDS):
            out[lower] = "REDACTED"
        else:
            out[lower] = value.replace(API_KEY, "REDACTED")
    return out


def redact_body(body: Any) -> Any:
    """
    The body with the API key replaced wherever it appears in a string.
    """
    if isinstance(body, dict):
        return {k: redact_body(v) for k, v in body.items()}
    if isinstance(body, list):
        return [redact_body(v) for v in body]
    if isinstance(body, str):
        return body.replace(API_KEY, "REDACTED")
    return body


class Recorder:
    """
    What the server has seen, and how it answers: C{mode} is C{"text"} (every
    generation answered with text) or C{"tool"} (the first request offering
    the shell tool answered with a call of it).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self.mode = "text"
        self.tool_called = False
        self.client = ""

    def reset(self, client: str, mode: str) -> None:
        with self.lock:
            self.requests = []
            self.mode = mode
            self.tool_called = False
            self.client = client

    def record(self, method: str, path: str, headers: dict[str, str], body: Any) -> None:
        with self.lock:
            self.requests.append({"method": method, "path": path, "headers": headers, "body": body})
        keys = sorted(body) if isinstance(body, dict) else body if body is None else type(body).__name__
        say(f"  {self.client}: {method} {path}  body keys: {keys}")

    def take_tool_turn(self) -> bool:
        """
        True once, for the first generation of a C{"tool"} run.
        """
        with self.lock:
            if self.mode == "tool" and not self.tool_called:
                self.tool_called = True
                return True
            return False


RECORDER = Recorder()


def sse(event: str, data: dict[str, Any], named: bool = True) -> bytes:
    head = f"event: {event}\n" if named else ""
    return (head + "data: " + json.dumps(data) + "\n\n").encode()


def anthropic_message(body: dict[str, Any], tool: bool) -> dict[str, Any]:
    """
    An Anthropic Messages response: a Bash tool call (C{echo hi}) if C{tool},
    else the text C{hi}.
    """
    if tool:
        content = [
            {
                "type": "tool_use",
                "id": "toolu_" + uuid.uuid4().hex[:24],
                "name": "Bash",
                "input": {"command": "echo hi", "description": "Print hi"},
            }
        ]
        stop = "tool_use"
    else:
        content = [{"type": "text", "text": "hi"}]
        stop = "end_turn"
    return {
        "id": "msg_" + uuid.uuid4().hex[:24],
        "type": "message",
        "role": "assistant",
        "model": body.get("model", MODEL),
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 2},
    }


def anthropic_stream(message: dict[str, Any]) -> bytes:
    start = dict(message, content=[], stop_reason=None, usage={"input_tokens": 10, "output_tokens": 0})
    out = [sse("message_start", {"type": "message_start", "message": start})]
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            out.append(
                sse(
                    "content_block_start",
                    {"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}},
                )
            )
            out.append(
                sse(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": block["text"]}},
                )
            )
        else:
            out.append(
                sse(
                    "content_block_start",
                    {"type": "content_block_start", "index": i, "content_block": dict(block, input={})},
                )
            )
            out.append(
                sse(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
                    },
                )
            )
        out.append(sse("content_block_stop", {"type": "content_block_stop", "index": i}))
    out.append(
        sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                "usage": {"output_tokens": 2},
            },
        )
    )
    out.append(sse("message_stop", {"type": "message_stop"}))
    return b"".join(out)


def tool_names(body: dict[str, Any]) -> set[str]:
    names = set()
    for tool in body.get("tools") or []:
        if isinstance(tool, dict) and tool.get("name"):
            names.add(tool["name"])
    return names


def codex_tool_call(body: dict[str, Any]) -> dict[str, Any]:
    """
    A Responses C{function_call} item running C{echo hi} through whichever
    shell tool this Codex offers.
    """
    names = tool_names(body)
    if "exec_command" in names:
        name, arguments = "exec_command", {"cmd": "echo hi"}
    elif "shell_command" in names:
        name, arguments = "shell_command", {"command": "echo hi"}
    else:
        name, arguments = "shell", {"command": ["bash", "-lc", "echo hi"]}
    return {
        "type": "function_call",
        "id": "fc_" + uuid.uuid4().hex[:24],
        "status": "completed",
        "call_id": "call_" + uuid.uuid4().hex[:24],
        "name": name,
        "arguments": json.dumps(arguments),
    }


def responses_stream(body: dict[str, Any], tool: bool) -> bytes:
    """
    A Responses API event stream: one function call item if C{tool}, else
    one assistant message saying C{hi}.
    """
    rid = "resp_" + uuid.uuid4().hex[:24]
    created = int(time.time())
    base = {
        "id": rid,
        "object": "response",
        "created_at": created,
        "model": body.get("model", MODEL),
        "status": "in_progress",
        "output": [],
    }
    seq = iter(range(1000))

    def ev(kind: str, **data: Any) -> bytes:
        return sse(kind, {"type": kind, "sequence_number": next(seq), **data})

    out = [ev("response.created", response=base), ev("response.in_progress", response=base)]
    if tool:
        item = codex_tool_call(body)
        out.append(
            ev("response.output_item.added", output_index=0, item=dict(item, arguments="", status="in_progress"))
        )
        out.append(
            ev("response.function_call_arguments.delta", output_index=0, item_id=item["id"], delta=item["arguments"])
        )
        out.append(
            ev("response.function_call_arguments.done", output_index=0, item_id=item["id"], arguments=item["arguments"])
        )
    else:
        mid = "msg_" + uuid.uuid4().hex[:24]
        part = {"type": "output_text", "text": "hi", "annotations": []}
        item = {"type": "message", "id": mid, "status": "completed", "role": "assistant", "content": [part]}
        out.append(ev("response.output_item.added", output_index=0, item=dict(item, content=[], status="in_progress")))
        out.append(
            ev("response.content_part.added", output_index=0, item_id=mid, content_index=0, part=dict(part, text=""))
        )
        out.append(ev("response.output_text.delta", output_index=0, item_id=mid, content_index=0, delta="hi"))
        out.append(ev("response.output_text.done", output_index=0, item_id=mid, content_index=0, text="hi"))
        out.append(ev("response.content_part.done", output_index=0, item_id=mid, content_index=0, part=part))
    out.append(ev("response.output_item.done", output_index=0, item=item))
    usage = {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 12,
    }
    out.append(ev("response.completed", response=dict(base, status="completed", output=[item], usage=usage)))
    return b"".join(out)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _body(self) -> Any:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return {"__raw__": raw.decode("utf-8", "replace")[:2000]}

    def _record(self) -> tuple[str, Any]:
        body = self._body()
        path = self.path
        RECORDER.record(self.command, path, dict(self.headers.items()), body)
        return path.split("?", 1)[0], body

    def _send(self, status: int, payload: bytes, content_type: str = "application/json", stream: bool = False) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("request-id", "req_" + uuid.uuid4().hex[:24])
        if stream:
            self.send_header("cache-control", "no-cache")
            self.send_header("connection", "close")
            self.close_connection = True
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _json(self, status: int, data: Any) -> None:
        self._send(status, json.dumps(data).encode())

    def do_HEAD(self) -> None:
        self._record()
        self._send(200, b"")

    def do_GET(self) -> None:
        path, _ = self._record()
        if path in ("/v1/models", "/models"):
            self._json(
                200,
                {
                    "object": "list",
                    "has_more": False,
                    "first_id": MODEL,
                    "last_id": MODEL,
                    "data": [
                        {
                            "id": MODEL,
                            "object": "model",
                            "type": "model",
                            "display_name": MODEL,
                            "created": 0,
                            "created_at": "2026-01-01T00:00:00Z",
                            "owned_by": "blazar",
                        }
                    ],
                },
            )
        elif path in ("/", "/health"):
            self._send(200, b"Blazar recorder\n", "text/plain")
        else:
            self._json(404, {"error": {"message": f"no route {path}", "type": "not_found_error"}})

    def do_POST(self) -> None:
        path, body = self._record()
        body = body if isinstance(body, dict) else {}
        if path == "/v1/messages/count_tokens":
            self._json(200, {"input_tokens": len(json.dumps(body)) // 4})
        elif path == "/v1/messages":
            tool = bool(body.get("tools")) and "Bash" in tool_names(body) and RECORDER.take_tool_turn()
            message = anthropic_message(body, tool)
            if body.get("stream"):
                self._send(200, anthropic_stream(message), "text/event-stream", stream=True)
            else:
                self._json(200, message)
        elif path == "/v1/responses":
            tool = bool(body.get("tools")) and RECORDER.take_tool_turn()
            self._send(200, responses_stream(body, tool), "text/event-stream", stream=True)
        else:
            self._json(404, {"error": {"message": f"no route {path}", "type": "not_found_error"}})

    do_PUT = do_DELETE = do_PATCH = do_POST


def has_tool_result(agent: Agent, body: Any) -> bool:
    """
    Whether a main request carries a tool's result back.
    """
    if not isinstance(body, dict):
        return False
    if agent is CLAUDE_CODE:
        for message in body.get("messages") or []:
            content = message.get("content")
            if isinstance(content, list) and any(
                isinstance(b, dict) and b.get("type") == "tool_result" for b in content
            ):
                return True
        return False
    items = body.get("input")
    return isinstance(items, list) and any(
        isinstance(i, dict) and i.get("type") == "function_call_output" for i in items
    )


def main_requests(agent: Agent, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    path = "/v1/messages" if agent is CLAUDE_CODE else "/v1/responses"
    return [
        r
        for r in requests
        if r["method"] == "POST"
        and r["path"].split("?")[0] == path
        and isinstance(r["body"], dict)
        and r["body"].get("tools")
    ]


def fixture(agent: Agent, request: dict[str, Any]) -> dict[str, Any]:
    return {
        "client": agent.name,
        "version": agent.version,
        "method": request["method"],
        "path": request["path"],
        "headers": redact_headers(request["headers"]),
        "body": redact_body(request["body"]),
    }


def run_agent(agent: Agent, base_url: str, mode: str, work: Path) -> subprocess.CompletedProcess[str]:
    """
    One run of C{agent} against the recorder, in a fresh home and working
    directory under C{work}.
    """
    home = work / "home"
    cwd = work / "project"
    cwd.mkdir(parents=True)
    (cwd / "notes.txt").write_text("hello from the recorder\n")
    exe = str(install(agent))
    if mode == "interactive":
        return run_claude_tui(exe, claude_environment(home, base_url, API_KEY), home, cwd)
    if agent is CLAUDE_CODE:
        env = claude_environment(home, base_url, API_KEY)
        argv = [
            exe,
            "-p",
            "say hi" if mode == "text" else "run `echo hi` and tell me what it printed",
            "--model",
            MODEL,
        ]
        if mode == "tool":
            argv += ["--allowedTools", "Bash(echo:*)"]
    else:
        env = codex_environment(home, base_url, API_KEY)
        argv = [exe, "exec", "--skip-git-repo-check", "--color", "never"]
        if mode == "tool":
            argv += ["--sandbox", "danger-full-access"]
        argv.append("say hi" if mode == "text" else "run `echo hi` and tell me what it printed")
    say(f"{agent.name} ({mode}): {' '.join(argv[1:])}")
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    say(f"{agent.name} ({mode}): exit {done.returncode}; stdout {done.stdout[-500:]!r}")
    if done.returncode != 0:
        say(f"stderr: {done.stderr[-3000:]}")
    return done


def run_claude_tui(exe: str, env: dict[str, str], home: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """
    Claude Code's interactive terminal UI in a pseudo-terminal: the folder
    marked trusted (or it stops at the trust dialog), C{say hi} typed once the
    UI is up, and C{/exit} once the recorder has seen the reply's request.
    """
    for path in (home / ".claude.json", home / ".claude" / ".claude.json"):
        state = json.loads(path.read_text())
        state["projects"] = {str(cwd): {"hasTrustDialogAccepted": True, "hasCompletedProjectOnboarding": True}}
        path.write_text(json.dumps(state))
    env = dict(env, TERM="xterm-256color")
    say(f"claude-code (interactive): {exe} --model {MODEL}, typing 'say hi'")
    pid, fd = pty.fork()
    if pid == 0:  # the child: never returns
        os.chdir(cwd)
        os.execve(exe, [exe, "--model", MODEL], env)
    screen = bytearray()

    def pump(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    screen.extend(os.read(fd, 65536))
                except OSError:
                    return

    pump(8)
    os.write(fd, b"say hi")
    pump(1)
    os.write(fd, b"\r")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not RECORDER.requests:
        pump(1)
    pump(3)
    os.write(fd, b"/exit\r")
    pump(3)
    for _ in range(50):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    os.close(fd)
    code = os.waitstatus_to_exitcode(status)
    text = screen.decode("utf-8", "replace")
    say(f"claude-code (interactive): exit {code}")
    return subprocess.CompletedProcess([exe], code, text, "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=[CLAUDE_CODE.name, CODEX.name])
    p.add_argument("--log", type=Path, help="also write every request seen here, as JSON lines")
    p.add_argument("--out", type=Path, default=FIXTURES)
    args = p.parse_args()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base_url = f"http://127.0.0.1:{server.server_address[1]}"
    args.out.mkdir(parents=True, exist_ok=True)
    failed = False
    log = open(args.log, "w") if args.log else None
    try:
        for agent in (CLAUDE_CODE, CODEX):
            if args.only and agent.name != args.only:
                continue
            modes = [("text", "first"), ("tool", "tool-result")]
            if agent is CLAUDE_CODE:
                modes.append(("interactive", "interactive-first"))
            for mode, name in modes:
                RECORDER.reset(agent.name, mode)
                with tempfile.TemporaryDirectory(prefix=f"blazar-rec-{agent.name}-") as tmp:
                    done = run_agent(agent, base_url, mode, Path(tmp))
                seen = list(RECORDER.requests)
                if log:
                    for r in seen:
                        log.write(json.dumps({"client": agent.name, "mode": mode, **fixture(agent, r)}) + "\n")
                mains = main_requests(agent, seen)
                if mode in ("text", "interactive"):
                    chosen = mains[0] if mains else None
                else:
                    chosen = next((r for r in mains if has_tool_result(agent, r["body"])), None)
                if done.returncode != 0 or chosen is None:
                    say(
                        f"{agent.name} ({mode}): no {name} request recorded "
                        f"(exit {done.returncode}, {len(mains)} main requests of {len(seen)})"
                    )
                    failed = True
                    continue
                path = args.out / f"{agent.name}-{name}.json"
                path.write_text(json.dumps(fixture(agent, chosen), ensure_ascii=False) + "\n")
                say(
                    f"wrote {path} ({path.stat().st_size} bytes); endpoints seen: "
                    + ", ".join(sorted({f"{r['method']} {r['path']}" for r in seen}))
                )
    finally:
        if log:
            log.close()
        server.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
