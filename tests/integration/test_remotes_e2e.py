"""
Remotes ([[remotes]]) end to end: a second real Blazar daemon (its own
llama-server child, its own keys) is the remote of the first, reached as
peer:tiny from the OpenAI, Anthropic, Ollama and Responses surfaces,
streamed and not, through the first daemon's keys, scopes, quotas and
metrics; the same peer spoken to as an Anthropic Messages API
(api = "anthropic") and as Ollama's /v1 with its model list asked
(models = "*"); a remote that is not there gets a 502 naming it, then an
open breaker's 503; a remote that refuses the key a 502 naming the config
key; the remote's key appears in neither log nor body.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import threading
import time
from typing import Iterator

import anthropic
import openai
import pytest
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam

from blazar.models.testmodel import GeneratedModel
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon, free_port
from tests.integration.test_tls_e2e import self_signed

PEER_SECRET = "peer-secret-remote-0123456789"
WRONG_SECRET = "wrong-secret-remote-0123456789"
ADMIN = "front-admin-0123456789"
LIMITED = "front-limited-0123456789"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
CLAUDE_HELLO: list[MessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def peer(engine: str, models: dict[str, GeneratedModel], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("peer")
    cert, key = self_signed(root)
    d = Daemon(root / "d", daemon_config(engine, models) + (f'[[keys]]\nname = "front"\nsecret = "{PEER_SECRET}"\n'))
    # a TLS listener too, for an https remote (its certificate trusted through SSL_CERT_FILE)
    d.tls_port, d.cert = free_port(), cert
    d.config.write_text(
        d.config.read_text().replace(
            f'listen = "tcp:{d.port}:interface=127.0.0.1"',
            f'listen = ["tcp:{d.port}:interface=127.0.0.1", '
            f'"ssl:{d.tls_port}:interface=127.0.0.1:privateKey={key}:certKey={cert}"]',
        )
    )
    d.start()
    try:
        yield d
    finally:
        d.close(check_engines=True)


class HeldRemote(http.server.ThreadingHTTPServer):
    """
    An OpenAI-compatible server that answers a chat completion only once
    C{release} is set (for what admission and the timeout do while a
    remote is slow; the real remote is the peer daemon above).
    """

    daemon_threads = True

    def __init__(self) -> None:
        self.release = threading.Event()
        self.seen = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                asked = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
                if asked.get("model") == "close":
                    self.close_delimited(bool(asked.get("stream")))
                    return
                if asked.get("model") == "limited":  # its own rate limit
                    body = b'{"error":{"message":"slow down","type":"rate_limit_error"}}'
                    self.send_response(429)
                    self.send_header("retry-after", "7")
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                outer.seen += 1
                if not outer.release.wait(30):
                    return
                text = json.dumps(
                    {
                        "id": "c",
                        "object": "chat.completion",
                        "created": 0,
                        "model": "m",
                        "choices": [
                            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    }
                )
                try:
                    self.send_response(200)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text.encode())
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the timed-out request: Blazar has hung up, as it should

            def close_delimited(self, stream: bool) -> None:
                # HTTP/1.0 with no content-length (Python's http.server apps, mlx_lm.server): the close ends it
                self.send_response(200)
                self.send_header("content-type", "text/event-stream" if stream else "application/json")
                self.end_headers()
                message = {"role": "assistant", "content": "closed"}
                if stream:
                    for chunk in ({"delta": message, "finish_reason": None}, {"delta": {}, "finish_reason": "stop"}):
                        event = {
                            "id": "c",
                            "object": "chat.completion.chunk",
                            "created": 0,
                            "model": "close",
                            "choices": [{"index": 0, **chunk}],
                        }
                        self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    self.wfile.write(b"data: [DONE]\n\n")
                else:
                    self.wfile.write(
                        json.dumps(
                            {
                                "id": "c",
                                "object": "chat.completion",
                                "created": 0,
                                "model": "close",
                                "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
                            }
                        ).encode()
                    )

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture(scope="module")
def held() -> Iterator[HeldRemote]:
    server = HeldRemote()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()


@pytest.fixture(scope="module")
def front(
    held: HeldRemote,
    peer: Daemon,
    engine: str,
    models: dict[str, GeneratedModel],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Daemon]:
    url = f"http://127.0.0.1:{peer.port}"
    config = (
        f'models_dir = "{models["tiny"].path.parent}"\n'
        "breaker_crashes = 2\nbreaker_backoff_secs = 60\n"
        f'[engines.llamacpp]\nbinary = "{engine}"\n'  # (nothing local runs in this module)
        f'[[remotes]]\nname = "peer"\nbase_url = "{url}/v1"\napi_key_env = "BLAZAR_TEST_PEER_KEY"\n'
        'models = ["tiny", "tiny-embed"]\nmax_concurrent = 2\n'
        f'[[remotes]]\nname = "claude"\nbase_url = "{url}"\napi = "anthropic"\napi_key = "{PEER_SECRET}"\n'
        'models = ["tiny"]\n'
        f'[[remotes]]\nname = "box"\nbase_url = "{url}"\napi = "ollama"\napi_key = "{PEER_SECRET}"\nmodels = "*"\n'
        f'[[remotes]]\nname = "secure"\nbase_url = "https://localhost:{peer.tls_port}/v1"\n'
        f'api_key = "{PEER_SECRET}"\nmodels = ["tiny"]\n'
        f'[[remotes]]\nname = "gone"\nbase_url = "http://127.0.0.1:{free_port()}"\nmodels = ["x"]\n'
        f'[[remotes]]\nname = "wrongkey"\nbase_url = "{url}"\napi_key = "{WRONG_SECRET}"\nmodels = ["tiny"]\n'
        f'[[remotes]]\nname = "held"\nbase_url = "http://127.0.0.1:{held.server_address[1]}"\nmodels = ["m", "t", "close", "limited"]\n'
        "max_concurrent = 1\ntimeout_secs = 2\n"
        f'[[keys]]\nname = "admin"\nsecret = "{ADMIN}"\n'
        f'[[keys]]\nname = "limited"\nsecret = "{LIMITED}"\nmodels = ["peer:tiny"]\nrpm = 3\n'
    )
    d = Daemon(tmp_path_factory.mktemp("front"), config)
    os.environ["BLAZAR_TEST_PEER_KEY"] = PEER_SECRET  # read by the daemon at each request
    os.environ["SSL_CERT_FILE"] = str(peer.cert)  # OpenSSL's trust store
    try:
        d.start()
    finally:
        del os.environ["BLAZAR_TEST_PEER_KEY"], os.environ["SSL_CERT_FILE"]
    try:
        yield d
    finally:
        d.close(check_engines=True)


def auth(secret: str = ADMIN) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def oai(d: Daemon, secret: str = ADMIN) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key=secret, max_retries=0, timeout=120)


def peer_requests(peer: Daemon, surface: str = "") -> float:
    """
    The requests for its tiny models the peer has answered (on
    C{surface}, or any), by its own metrics, read with its key.
    """
    status, _, body = peer.request("GET", "/metrics", headers=auth(PEER_SECRET))
    assert status == 200
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith("blazar_requests_total{") and 'model="tiny' in line and f'surface="{surface}' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_listed_with_their_remote_names(front: Daemon) -> None:
    ids = {m.id: m for m in oai(front).models.list()}
    for name in ("peer:tiny", "peer:tiny-embed", "claude:tiny", "gone:x"):
        assert name in ids, sorted(ids)
    assert ids["peer:tiny"].owned_by == "peer"
    # models = "*": what the peer's /v1/models lists, asked at start
    deadline = time.monotonic() + 10
    while not any(i.startswith("box:") for i in ids) and time.monotonic() < deadline:
        time.sleep(0.2)
        ids = {m.id: m for m in oai(front).models.list()}
    assert "box:tiny:latest" in ids, sorted(ids)
    status, _, body = front.request("GET", "/api/tags", headers=auth())
    tags = {m["name"]: m for m in json.loads(body)["models"]}
    assert tags["peer:tiny"]["remote_host"] == "peer" and tags["peer:tiny"]["remote_model"] == "tiny"
    # a scoped key sees only its own
    limited = {m.id for m in oai(front, LIMITED).models.list()}
    assert limited == {"peer:tiny"}
    # and the dashboard's Models page lists them as remote
    status, _, body = front.request("GET", "/ui/api/models", headers=auth())
    rows = {r["name"]: r for r in json.loads(body)["files"]}
    assert status == 200 and rows["peer:tiny"]["kind"] == "remote", body[:500]


def test_openai_surface_streamed_and_not(front: Daemon, peer: Daemon) -> None:
    before = peer_requests(peer)
    client = oai(front)
    answer = client.chat.completions.create(model="peer:tiny", messages=HELLO, max_tokens=4)
    assert answer.choices[0].message.content is not None
    assert answer.usage is not None and answer.usage.completion_tokens > 0
    assert answer.model == "peer:tiny"  # the name asked for, not the remote's own
    chunks = list(
        client.chat.completions.create(
            model="PEER:tiny", messages=HELLO, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 2 and isinstance(text, str)
    assert {c.model for c in chunks} == {"PEER:tiny"}  # as spelled, on every chunk
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    embedded = client.embeddings.create(model="peer:tiny-embed", input="hello")
    assert len(embedded.data[0].embedding) > 8 and embedded.model == "peer:tiny-embed"
    completion = client.completions.create(model="peer:tiny", prompt="once", max_tokens=3)
    assert completion.choices[0].text is not None
    # the peer answered every one of them; the front started no engine of its own
    assert peer_requests(peer) >= before + 4
    assert front.engines() == []


def test_anthropic_and_responses_and_ollama_surfaces(front: Daemon) -> None:
    claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{front.port}", api_key=ADMIN, max_retries=0)
    message = claude.messages.create(model="peer:tiny", max_tokens=4, messages=CLAUDE_HELLO)
    assert message.role == "assistant" and message.usage.output_tokens > 0
    with claude.messages.stream(model="peer:tiny", max_tokens=4, messages=CLAUDE_HELLO) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("max_tokens", "end_turn")

    client = oai(front)
    response = client.responses.create(model="peer:tiny", input="hi", max_output_tokens=16)
    assert response.status in ("completed", "incomplete") and response.usage is not None
    events = [e.type for e in client.responses.create(model="peer:tiny", input="hi", max_output_tokens=16, stream=True)]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")

    status, _, body = front.request(
        "POST",
        "/api/chat",
        {"model": "peer:tiny", "messages": HELLO, "stream": False, "options": {"num_predict": 4}},
        headers=auth(),
    )
    assert status == 200, body
    assert json.loads(body)["message"]["role"] == "assistant"
    status, _, body = front.request(
        "POST", "/api/chat", {"model": "peer:tiny", "messages": HELLO, "options": {"num_predict": 4}}, headers=auth()
    )
    lines = [json.loads(line) for line in body.splitlines() if line.strip()]
    assert status == 200 and lines[-1]["done"] is True and lines[-1]["eval_count"] > 0
    status, _, body = front.request(
        "POST",
        "/api/generate",
        {"model": "peer:tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 4}},
        headers=auth(),
    )
    assert status == 200 and json.loads(body)["done"] is True, body
    status, _, body = front.request(
        "POST", "/api/embed", {"model": "peer:tiny-embed", "input": ["a", "b"]}, headers=auth()
    )
    assert status == 200 and len(json.loads(body)["embeddings"]) == 2, body


def test_anthropic_api_remote(front: Daemon, peer: Daemon) -> None:
    # api = "anthropic": the front speaks Messages to the peer's /v1/messages and translates back
    before = peer_requests(peer, "anthropic")
    client = oai(front)
    answer = client.chat.completions.create(model="claude:tiny", messages=HELLO, max_tokens=4)
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert answer.usage is not None and answer.usage.completion_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model="claude:tiny", messages=HELLO, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert peer_requests(peer, "anthropic") == before + 2  # both went to the peer's Messages surface
    # the other surfaces reach it too: Anthropic in, OpenAI inside, Anthropic out, and back
    claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{front.port}", api_key=ADMIN, max_retries=0)
    with claude.messages.stream(model="claude:tiny", max_tokens=4, messages=CLAUDE_HELLO) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("max_tokens", "end_turn") and final.usage.output_tokens > 0
    events = [
        e.type for e in client.responses.create(model="claude:tiny", input="hi", max_output_tokens=16, stream=True)
    ]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
    assert peer_requests(peer, "anthropic") == before + 4
    # Messages has no n: refused, not silently one answer
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="claude:tiny", messages=HELLO, max_tokens=4, n=2)
    # an ollama-api remote with models = "*" serves what it lists
    answer = client.chat.completions.create(model="box:tiny:latest", messages=HELLO, max_tokens=4)
    assert answer.choices[0].message is not None and answer.model == "box:tiny:latest"
    answer = client.chat.completions.create(model="box:tiny", messages=HELLO, max_tokens=4)
    assert answer.model == "box:tiny"  # a bare name means the :latest it lists, as on Ollama and Blazar
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="box:never-listed", messages=HELLO, max_tokens=4)


def test_front_keys_scopes_and_quotas_apply(front: Daemon) -> None:
    limited = oai(front, LIMITED)
    with pytest.raises(openai.NotFoundError):
        limited.chat.completions.create(model="claude:tiny", messages=HELLO, max_tokens=2)
    with pytest.raises(openai.NotFoundError):  # a remote's ids are case-sensitive: exactly as scoped
        limited.chat.completions.create(model="peer:TINY", messages=HELLO, max_tokens=2)
    codes = []
    for _ in range(4):
        status, _, _ = front.request(
            "POST",
            "/v1/chat/completions",
            {"model": "peer:tiny", "messages": HELLO, "max_tokens": 2},
            headers=auth(LIMITED),
        )
        codes.append(status)
    assert codes[:3] == [200, 200, 200] and codes[3] == 429, codes  # rpm = 3 (a scope refusal is not counted)
    status, _, _ = front.request(
        "POST", "/v1/chat/completions", {"model": "peer:tiny", "messages": HELLO, "max_tokens": 2}
    )
    assert status == 401
    status, _, body = front.request("GET", "/metrics", headers=auth())
    metrics = body.decode()
    assert 'blazar_remote_requests_total{key="admin",model="peer:tiny",remote="peer",status="2xx"}' in metrics


def test_a_remote_that_is_not_there_opens_its_breaker(front: Daemon) -> None:
    body = {"model": "gone:x", "messages": HELLO, "max_tokens": 2}
    status, _, first = front.request("POST", "/v1/chat/completions", body, headers=auth())
    assert status == 502, first
    assert "remote 'gone'" in json.loads(first)["error"]["message"]
    front.request("POST", "/v1/chat/completions", body, headers=auth())
    status, headers, third = front.request("POST", "/v1/chat/completions", body, headers=auth())
    assert status == 503, third
    assert "retry-after" in headers
    assert "remote 'gone'" in json.loads(third)["error"]["message"]
    # on the Anthropic surface, in its own shape (Anthropic's "overloaded" status)
    status, _, data = front.request(
        "POST", "/v1/messages", {"model": "gone:x", "max_tokens": 2, "messages": HELLO}, headers=auth()
    )
    assert status == 529 and json.loads(data)["type"] == "error", data
    assert "remote 'gone'" in json.loads(data)["error"]["message"]


def test_a_refused_key_names_the_config_and_no_key_is_shown(front: Daemon) -> None:
    status, _, body = front.request(
        "POST", "/v1/chat/completions", {"model": "wrongkey:tiny", "messages": HELLO, "max_tokens": 2}, headers=auth()
    )
    assert status == 502, body
    message = json.loads(body)["error"]["message"]
    assert "api_key" in message and "wrongkey" in message
    assert WRONG_SECRET not in message
    log = front.log()
    assert PEER_SECRET not in log and WRONG_SECRET not in log
    config_free = front.log() + json.dumps(front.request("GET", "/api/ps", headers=auth())[2].decode())
    assert PEER_SECRET not in config_free


def test_max_concurrent_is_the_remotes_slots_and_timeout_secs_its_bound(front: Daemon, held: HeldRemote) -> None:
    body = {"model": "held:m", "messages": HELLO, "max_tokens": 2}
    results: dict[str, tuple[int, dict[str, str], bytes]] = {}

    def send(name: str) -> None:
        results[name] = front.request("POST", "/v1/chat/completions", body, headers=auth(), timeout=60)

    held.release.clear()
    first = threading.Thread(target=send, args=("first",))
    first.start()
    deadline = time.monotonic() + 10
    while held.seen < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    second = threading.Thread(target=send, args=("second",))
    second.start()
    # max_concurrent = 1: the second waits in Blazar's queue, not at the remote
    queued = None
    while time.monotonic() < deadline:
        queues = json.loads(front.request("GET", "/api/queue", headers=auth())[2])["models"]
        queued = next((q for q in queues if q["model"] == "held:*"), None)
        if queued is not None and queued["waiting"]["total"] == 1:
            break
        time.sleep(0.05)
    assert queued is not None and queued["slots"] == {"busy": 1, "total": 1}, queued
    assert queued["model"] == "held:*"  # one queue for the remote: its other models wait in it too
    assert queued["waiting"]["total"] == 1 and held.seen == 1
    time.sleep(0.3)
    held.release.set()
    first.join(30)
    second.join(30)
    assert results["first"][0] == 200 and results["second"][0] == 200, results
    assert float(results["second"][1]["x-blazar-queue-ms"]) >= 300
    assert json.loads(results["second"][2])["choices"][0]["message"]["content"] == "ok"

    # a remote that sends nothing within timeout_secs: a 504 naming the key, once (never sent twice)
    held.release.clear()
    seen = held.seen
    status, _, data = front.request("POST", "/v1/chat/completions", {**body, "model": "held:t"}, headers=auth())
    held.release.set()
    assert status == 504, data
    assert "timeout_secs" in json.loads(data)["error"]["message"]
    assert held.seen == seen + 1


def test_an_https_remote(front: Daemon) -> None:
    # TLS to the peer's ssl: listener, its certificate checked against the trust store and the host name
    answer = oai(front).chat.completions.create(model="secure:tiny", messages=HELLO, max_tokens=2)
    assert answer.choices[0].message.role == "assistant"
    chunks = list(oai(front).chat.completions.create(model="secure:tiny", messages=HELLO, max_tokens=2, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_the_remote_stopped_opens_its_breaker(front: Daemon, peer: Daemon) -> None:
    # last in the module: it stops the peer
    assert oai(front).chat.completions.create(model="peer:tiny", messages=HELLO, max_tokens=2).choices
    code = peer.stop()
    assert code in (0, -signal.SIGTERM)
    body = {"model": "peer:tiny", "messages": HELLO, "max_tokens": 2}
    status, _, first = front.request("POST", "/v1/chat/completions", body, headers=auth())
    assert status == 502, first
    assert "remote 'peer'" in json.loads(first)["error"]["message"]
    status, _, second = front.request("POST", "/api/chat", {**body, "stream": False}, headers=auth())
    assert status == 502 and "remote 'peer'" in json.loads(second)["error"], second  # Ollama's shape
    with pytest.raises(openai.APIStatusError) as caught:
        list(oai(front).chat.completions.create(model="peer:tiny", messages=HELLO, max_tokens=2, stream=True))
    assert caught.value.status_code == 503 and "failed 2 times lately" in str(caught.value)
    status, _, metrics = front.request("GET", "/metrics", headers=auth())
    assert 'blazar_breaker_state{model="peer:*"} 2.0' in metrics.decode()  # one breaker for the remote
    status, _, data = front.request(
        "POST", "/v1/embeddings", {"model": "peer:tiny-embed", "input": "x"}, headers=auth()
    )
    assert status == 503, data  # its other models too
    assert PEER_SECRET not in front.log()


def test_a_close_delimited_answer_is_whole(front: Daemon) -> None:
    # HTTP/1.0 without a length: the close ends the body (a local child's close without one is a crash)
    client = oai(front)
    answer = client.chat.completions.create(model="held:close", messages=HELLO, max_tokens=2)
    assert answer.choices[0].message.content == "closed" and answer.model == "held:close"
    chunks = list(client.chat.completions.create(model="held:close", messages=HELLO, max_tokens=2, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "closed"


def test_a_remotes_rate_limit_is_passed_on_with_its_retry_after(front: Daemon) -> None:
    status, headers, body = front.request(
        "POST", "/v1/chat/completions", {"model": "held:limited", "messages": HELLO}, headers=auth()
    )
    assert status == 429 and headers.get("retry-after") == "7", (status, headers, body)
    assert "slow down" in json.loads(body)["error"]["message"]
    status, headers, _ = front.request(
        "POST", "/v1/messages", {"model": "held:limited", "max_tokens": 2, "messages": HELLO}, headers=auth()
    )
    assert status == 429 and headers.get("retry-after") == "7"
