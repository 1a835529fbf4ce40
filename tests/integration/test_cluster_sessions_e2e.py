"""
Sessions stay where their KV is (issue 42): two real daemons on one real
PostgreSQL (C{[cluster] database}), each with its own real llama-server
serving SmolLM2-135M-Instruct. A session's first turns run on node A;
its next turn, sent to node B, is forwarded to A, which answers it from
the slot that kept the conversation's KV (llama-server's own
C{usage.prompt_tokens_details.cached_tokens}); a streamed turn sent to B
arrives whole; a streamed turn that A is SIGKILLed in the middle of ends
with an error at the client (never a clean end); and then B serves the
session itself.
"""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests import postgres
from tests.integration.harness import Daemon, real_model

ALICE = "sk-alice-0123456789abcdef0123"
WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
    "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


@pytest.fixture()
def server() -> Iterator[postgres.PostgresServer]:
    made = postgres.server()  # without PostgreSQL: a failure in CI, else a skip that says what to install
    try:
        yield made
    finally:
        made.remove()


def node(root: Path, name: str, engine: str, database: str) -> Daemon:
    (root / "models").mkdir(parents=True)
    (root / "models" / "smollm.gguf").symlink_to(real_model())
    return Daemon(
        root,
        f'models_dir = "{root / "models"}"\n'
        '[models."smol"]\npath = "smollm.gguf"\nparallel = 1\nctx_size = 2048\n'
        f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
        f'[[keys]]\nname = "alice"\nsecret = "{ALICE}"\n'
        f'[cluster]\ndatabase = "{database}"\nnode = "{name}"\n',
    )


def chat(d: Daemon, messages: list[dict[str, str]], session: str) -> tuple[int, dict[str, str], Any]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=300)
    try:
        body = {"model": "smol", "messages": messages, "max_tokens": 8, "temperature": 0, "seed": 1}
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"content-type": "application/json", "authorization": f"Bearer {ALICE}", "x-blazar-session": session},
        )
        resp = conn.getresponse()
        headers = {k.lower(): v for k, v in resp.getheaders()}
        data = resp.read()
        return resp.status, headers, json.loads(data) if data.startswith(b"{") else data
    finally:
        conn.close()


def stream(d: Daemon, messages: list[dict[str, str]], session: str) -> tuple[dict[str, str], list[str]]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=300)
    try:
        body = {"model": "smol", "messages": messages, "max_tokens": 16, "temperature": 0, "stream": True}
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"content-type": "application/json", "authorization": f"Bearer {ALICE}", "x-blazar-session": session},
        )
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()[:500]
        headers = {k.lower(): v for k, v in resp.getheaders()}
        # http.client raises IncompleteRead on a chunked body cut short: reading it all proves it whole
        text = resp.read().decode()
        return headers, [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    finally:
        conn.close()


def cut_stream(d: Daemon, messages: list[dict[str, str]], session: str, kill: Daemon) -> tuple[list[str], str]:
    """
    A long streamed answer through C{d}; once its first event is in,
    C{kill} (the holder) is SIGKILLed with its engine.

    @return: The events read, and the error the read ended with (C{""}:
        it ended cleanly).
    """
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=120)
    events: list[str] = []
    try:
        body = {
            "model": "smol",
            "messages": messages,
            "max_tokens": 1000,
            "ignore_eos": True,  # (llama-server's: the answer runs long enough to be cut)
            "temperature": 0,
            "stream": True,
        }
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"content-type": "application/json", "authorization": f"Bearer {ALICE}", "x-blazar-session": session},
        )
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()[:500]
        assert resp.getheader("x-blazar-served-by") == "a"
        # (read1, not readline: http.client's readline takes a chunked body cut short for its end)
        buffer = b""
        try:
            while data := resp.read1(65536):
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                events += [line[6:].decode() for line in lines if line.startswith(b"data: ")]
                if events and kill.proc is not None and kill.proc.poll() is None:
                    kill.kill_everything()
            return events, ""
        except (http.client.HTTPException, OSError) as e:
            return events, type(e).__name__
    finally:
        conn.close()


class Conversation:
    def __init__(self, session: str) -> None:
        self.session = session
        system = "You are a terse assistant. " + " ".join(WORDS[i % len(WORDS)] for i in range(300))
        self.messages = [{"role": "system", "content": system}]

    def turn(self, d: Daemon, i: int) -> tuple[dict[str, str], int, int]:
        """
        @return: The response headers, the prompt tokens and how many of
            them came from the cache.
        """
        self.messages.append({"role": "user", "content": f"Turn {i}: " + " ".join(WORDS[i : i + 5])})
        status, headers, reply = chat(d, self.messages, self.session)
        assert status == 200, reply
        self.messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
        usage = reply["usage"]
        return headers, usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def sessions_of(d: Daemon) -> dict[str, str]:
    status, _, body = d.request("GET", "/api/session", headers={"authorization": f"Bearer {ALICE}"})
    assert status == 200, body
    return {s["session"]: s["node"] for s in json.loads(body)["sessions"]}


def test_a_session_is_served_where_its_kv_is(server: postgres.PostgresServer, engine: str, tmp_path: Path) -> None:
    database = server.new_database()
    a = node(tmp_path / "a", "a", engine, database)
    b = node(tmp_path / "b", "b", engine, database)
    try:
        a.start()
        b.start()
        talk = Conversation("kept")
        for i in range(2):
            headers, _, _ = talk.turn(a, i)
            assert "x-blazar-served-by" not in headers  # (sent to A: served there, not forwarded)
        assert sessions_of(b) == {"kept": "a"}  # the index, as B lists it

        # the third turn sent to B: forwarded to A, whose slot kept the conversation
        headers, prompt, cached = talk.turn(b, 2)
        assert headers.get("x-blazar-served-by") == "a", headers
        assert cached >= 0.8 * prompt, (cached, prompt)
        assert not b.engines(), "B started an engine for a request A served"

        # streamed through B, whole: every event, the finish, [DONE]
        talk.messages.append({"role": "user", "content": "And one more, streamed."})
        headers, events = stream(b, talk.messages, "kept")
        assert headers.get("x-blazar-served-by") == "a", headers
        assert events[-1] == "[DONE]", events
        chunks = [json.loads(e) for e in events[:-1]]
        assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks), chunks
        text = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
        assert text.strip(), chunks
        talk.messages.append({"role": "assistant", "content": text})

        # A dies while B relays its streamed answer: the client's stream ends with an error
        events, error = cut_stream(b, talk.messages + [{"role": "user", "content": "Count to a thousand."}], "kept", a)
        assert error and "[DONE]" not in events, (error, events[-3:])
        assert b.logged("stopped answering session kept's request before its end", timeout=10) == 1, b.log()[-3000:]

        # and then: B serves the session itself (a fresh prefill) and takes it over in the index
        started = time.monotonic()
        headers, prompt, cached = talk.turn(b, 3)
        assert "x-blazar-served-by" not in headers, headers
        assert cached < 0.5 * prompt, (cached, prompt)  # B never had this conversation's KV
        assert time.monotonic() - started < 120
        assert b.logged("which could not be reached", timeout=10) >= 1, b.log()[-3000:]
        assert sessions_of(b) == {"kept": "b"}
        headers, _, _ = talk.turn(b, 4)  # the index says B now: no forward, no take-over again
        assert b.log().count("which could not be reached") == 1
    finally:
        for d in (a, b):
            if d.proc is not None and d.proc.poll() is None:
                d.close()
            else:
                d.kill_everything()
