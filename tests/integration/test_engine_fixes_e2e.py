"""
Where llama-server's own answer breaks clients, Blazar's translation is what
clients get (issue 17, item 5), end to end: one real daemon with keys on,
real llama-server children, the generated random-weight model, the official
openai SDK where it parses the answer.

What the pinned engine does by itself (checked against it directly):
  - a C{/v1/completions} stream's usage rides the last choice's chunk, with
    or without C{stream_options.include_usage};
  - C{/v1/completions} logprobs come in the chat shape, and C{echo} is
    ignored;
  - C{logprobs} with C{tools} and C{stream} on chat is a 400 ("logprobs is
    not supported with tools + stream");
  - bodies are read whole before anything answers.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from typing import Any, Iterator, cast

import openai
import pytest

from blazar.models.testmodel import GeneratedModel
from blazar.testing import forced_tool_call_request
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon

KEY = "fixes-secret-0123456789"
SAME_TEXT = re.compile("\ufffd+")
LIMIT = 1 << 20
PROMPT = "Hello"


@pytest.fixture(scope="module")
def daemon(
    engine: str, models: dict[str, GeneratedModel], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("fixes"), daemon_config(engine, models) + (f'[[keys]]\nname = "k"\nsecret = "{KEY}"\n')
    )
    # a top-level key: it goes before the config's tables
    d.config.write_text(f"max_body_bytes = {LIMIT}\n" + d.config.read_text())
    d.start()
    try:
        yield d
    finally:
        d.close()


def client(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key=KEY, max_retries=0, timeout=60)


def post(d: Daemon, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=120)
    try:
        conn.request(
            "POST", path, json.dumps(body), {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def events(d: Daemon, path: str, body: dict[str, Any]) -> list[Any]:
    """
    The SSE payloads of a streamed answer: parsed JSON, and C{"[DONE]"}.
    """
    status, data = post(d, path, body)
    assert status == 200, data[:500]
    out = []
    for event in data.decode("utf-8").split("\n\n"):
        if not event or event.startswith(":"):
            continue  # (": loading" while a cold model loads)
        assert event.startswith("data: ") and "\n" not in event, event
        payload = event[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    assert out[-1] == "[DONE]" and out.count("[DONE]") == 1
    return out


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "seed": 1, **fields}


# -- a. the usage chunk of a completion stream ---------------------------------


def test_completion_stream_usage_chunk_has_no_choices(daemon: Daemon) -> None:
    *chunks, usage, _ = events(
        daemon, "/v1/completions", completion(stream=True, stream_options={"include_usage": True})
    )
    assert usage["choices"] == [] and usage["object"] == "text_completion" and usage["model"] == "tiny"
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + usage["usage"]["completion_tokens"] > 0
    assert all(not c.get("usage") for c in chunks), chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all(len(c["choices"]) == 1 for c in chunks)


def test_completion_stream_without_include_usage_has_no_usage(daemon: Daemon) -> None:
    *chunks, _ = events(daemon, "/v1/completions", completion(stream=True))
    assert all(not c.get("usage") for c in chunks), chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_completion_stream_usage_with_the_sdk(daemon: Daemon) -> None:
    stream = client(daemon).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, seed=1, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks[:-1])


def test_several_prompts_one_usage_chunk(daemon: Daemon) -> None:
    *chunks, usage, _ = events(
        daemon, "/v1/completions", completion(prompt=["Hi", "Yo"], stream=True, stream_options={"include_usage": True})
    )
    assert None not in chunks  # the engine opens this stream with "data: null"
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12


# -- b. legacy logprobs and echo ------------------------------------------------


def token_bytes(name: str) -> bytes:
    """
    A legacy token's bytes (C{"bytes:\\xNN..."} names a token that is
    not whole UTF-8).
    """
    if name.startswith("bytes:"):
        return bytes(int(h, 16) for h in name[len("bytes:") :].split("\\x")[1:])
    return name.encode("utf-8")


def same_text(a: str, b: str) -> bool:
    # the engine writes U+FFFD for bytes that are not UTF-8, not always as many
    return SAME_TEXT.sub("\ufffd", a) == SAME_TEXT.sub("\ufffd", b)


def assert_legacy(logprobs: dict[str, Any], n: int, count: int) -> None:
    """
    OpenAI's legacy shape, C{count} tokens at most (the engine gives a
    token that ends inside a UTF-8 character no entry of its own: its bytes
    come with the next one's).
    """
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert (
        len(logprobs["tokens"])
        == len(logprobs["token_logprobs"])
        == len(logprobs["top_logprobs"])
        == len(logprobs["text_offset"])
    )
    assert 1 <= len(logprobs["tokens"]) <= count
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert isinstance(token, str) and isinstance(logprob, float) and logprob <= 0
        assert isinstance(top, dict) and 1 <= len(top) <= n + 1 and top[token] == logprob
        assert all(isinstance(k, str) and isinstance(v, float) for k, v in top.items())
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_completion_logprobs_legacy_shape(daemon: Daemon) -> None:
    status, data = post(daemon, "/v1/completions", completion(logprobs=2))
    assert status == 200, data
    reply = json.loads(data)
    (choice,) = reply["choices"]
    assert "content" not in choice["logprobs"]  # not the engine's chat shape
    lp = choice["logprobs"]
    assert_legacy(lp, 2, reply["usage"]["completion_tokens"])
    assert lp["text_offset"][0] == len(PROMPT)  # counted from the prompt's start
    # the tokens spell the text; the engine has no entry for a last token
    # that left a UTF-8 character unfinished (nor for what follows it)
    text = b"".join(token_bytes(t) for t in lp["tokens"]).decode("utf-8", "replace")
    assert SAME_TEXT.sub("\ufffd", choice["text"]).startswith(SAME_TEXT.sub("\ufffd", text)), (
        lp["tokens"],
        choice["text"],
    )
    # with the SDK: its typed legacy object
    typed = client(daemon).completions.create(model="tiny", prompt=PROMPT, max_tokens=6, seed=1, logprobs=0)
    lp = typed.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.text_offset
    assert lp.top_logprobs is not None and all(len(t) == 1 for t in lp.top_logprobs)  # the sampled token only


def test_completion_logprobs_streamed(daemon: Daemon) -> None:
    *chunks, _ = events(daemon, "/v1/completions", completion(logprobs=3, stream=True))
    tokens: list[str] = []
    offsets: list[int] = []
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        if lp is None:
            assert c["choices"][0]["finish_reason"] is not None
            continue
        assert "content" not in lp
        assert_legacy(lp, 3, len(lp["tokens"]))
        tokens += lp["tokens"]
        offsets += lp["text_offset"]
    assert 1 <= len(tokens) <= 6 and offsets[0] == len(PROMPT) and offsets == sorted(offsets)
    status, data = post(daemon, "/v1/completions", completion(logprobs=3))
    assert json.loads(data)["choices"][0]["logprobs"]["tokens"] == tokens  # same seed, same tokens


def test_completion_echo(daemon: Daemon) -> None:
    status, data = post(daemon, "/v1/completions", completion(echo=True))
    assert status == 200, data
    (choice,) = json.loads(data)["choices"]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    assert choice["logprobs"] is None


def test_completion_echo_with_logprobs(daemon: Daemon) -> None:
    reply = client(daemon).completions.create(model="tiny", prompt=PROMPT, max_tokens=6, seed=1, logprobs=1, echo=True)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.text_offset is not None and lp.top_logprobs is not None
    assert choice.text.startswith(PROMPT)
    assert "".join(lp.tokens[:5]) == PROMPT  # the prompt's own tokens (this vocabulary: one per letter)
    assert lp.token_logprobs[:5] == [None] * 5 and lp.top_logprobs[:5] == [None] * 5  # the engine scores no prompt
    assert lp.text_offset[:6] == [0, 1, 2, 3, 4, 5]
    assert reply.usage is not None and 5 < len(lp.tokens) <= 5 + reply.usage.completion_tokens
    assert all(isinstance(x, float) for x in lp.token_logprobs[5:])


def test_completion_echo_streamed(daemon: Daemon) -> None:
    first, *chunks, _ = events(daemon, "/v1/completions", completion(echo=True, logprobs=1, stream=True))
    assert first["choices"][0]["text"] == PROMPT and first["choices"][0]["finish_reason"] is None
    assert first["choices"][0]["logprobs"]["tokens"] == list(PROMPT)
    assert chunks[0]["choices"][0]["logprobs"]["text_offset"] == [len(PROMPT)]


def test_echo_of_a_token_prompt(daemon: Daemon) -> None:
    status, data = post(daemon, "/v1/completions", completion(prompt=[75, 104], echo=True))  # "H", "e"
    assert status == 200, data
    assert json.loads(data)["choices"][0]["text"].startswith("He")


def test_malformed_logprobs_is_a_400_naming_it(daemon: Daemon) -> None:
    status, data = post(daemon, "/v1/completions", completion(logprobs="two"))
    assert status == 400 and json.loads(data)["error"]["param"] == "logprobs"


# -- c. logprobs with tools and stream on chat ---------------------------------


def tool_body(**fields: Any) -> dict[str, Any]:
    body = forced_tool_call_request("tiny", seed=2, stream=True, tool_choice="auto")
    body.pop("logit_bias")  # let the random model write text
    return {**body, "max_tokens": 40, "logprobs": True, "top_logprobs": 2, **fields}


def test_logprobs_with_tools_and_stream_are_served(daemon: Daemon) -> None:
    """
    A stream carries the logprobs of every content token the engine gives
    them for, the same as the answer not streamed (issue 35: streamed by the
    engine, those of text its tool-call parser held back were lost, and
    such chunks had logprobs null); tool-call and other chunks have null.
    """
    for seed in range(1, 11):
        whole = json.loads(post(daemon, "/v1/chat/completions", tool_body(seed=seed, stream=False))[1])
        content = whole["choices"][0]["message"].get("content") or ""
        expected = [e["token"] for e in whole["choices"][0]["logprobs"]["content"]]
        while (
            expected
            and not same_text(content[:0] + "".join(expected), content[: len("".join(expected))])
            and not SAME_TEXT.sub("\ufffd", content).startswith(SAME_TEXT.sub("\ufffd", "".join(expected)))
        ):
            expected.pop()  # the tool-call markup's tokens: not the content's
        chunks = [c for c in events(daemon, "/v1/chat/completions", tool_body(seed=seed)) if c != "[DONE]"]
        streamed, text = [], ""
        for c in chunks:
            for choice in c["choices"]:
                assert "logprobs" in choice
                delta, lp = choice["delta"], choice["logprobs"]
                if not delta.get("content"):
                    assert lp is None, choice
                    continue
                text += delta["content"]
                assert lp is not None and lp["refusal"] is None, (seed, choice)
                for e in lp["content"]:
                    assert isinstance(e["logprob"], float) and len(e["top_logprobs"]) <= 2
                    streamed.append(e["token"])
        assert same_text(text, content), (seed, text, content)
        assert streamed == expected, (seed, streamed, expected)
        assert streamed or not content, (seed, whole)


def test_logprobs_with_tools_and_stream_with_the_sdk(daemon: Daemon) -> None:
    body = tool_body()
    stream = client(daemon).chat.completions.create(
        model="tiny",
        messages=body["messages"],
        tools=body["tools"],
        stream=True,
        logprobs=True,
        top_logprobs=1,
        max_tokens=20,
        seed=2,
    )
    contents = [c.choices[0].logprobs.content for c in stream if c.choices and c.choices[0].logprobs]
    assert contents and all(len(e.top_logprobs) <= 1 for entries in contents for e in entries or [])


def test_tool_call_chunks_carry_null_logprobs(daemon: Daemon) -> None:
    body = {**forced_tool_call_request("tiny", seed=1, stream=True), "logprobs": True}
    chunks = [c for c in events(daemon, "/v1/chat/completions", body) if c != "[DONE]"]
    calls = [ch for c in chunks for ch in c["choices"] if ch["delta"].get("tool_calls")]
    assert calls, chunks
    assert all("logprobs" in ch and ch["logprobs"] is None for ch in calls)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# -- d. a body over max_body_bytes: 413 at the headers -------------------------


def send_head(d: Daemon, path: str, *headers: str, length: int = LIMIT + 1) -> tuple[bytes, float]:
    """
    Send only a request's head announcing C{length} body bytes, read
    until the daemon closes; the answer and how long it took.
    """
    head = "\r\n".join(
        [
            f"POST {path} HTTP/1.1",
            "Host: 127.0.0.1",
            "Content-Type: application/json",
            f"Content-Length: {length}",
            *headers,
            "",
            "",
        ]
    )
    began = time.monotonic()
    with socket.create_connection(("127.0.0.1", d.port), timeout=10) as s:
        s.sendall(head.encode("ascii"))
        data = b""
        while True:
            piece = s.recv(65536)  # a timeout here fails: the daemon must close
            if not piece:
                break
            data += piece
    return data, time.monotonic() - began


@pytest.mark.parametrize(
    "path,surface",
    [
        ("/v1/chat/completions", "openai"),
        ("/v1/completions", "openai"),
        ("/v1/embeddings", "openai"),
        ("/v1/responses", "responses"),
        ("/v1/messages", "anthropic"),
        ("/api/chat", "ollama"),
        ("/api/generate", "ollama"),
    ],
)
def test_oversized_body_is_refused_at_the_headers(daemon: Daemon, path: str, surface: str) -> None:
    # no key: the limit comes before auth, so the body is never invited
    data, took = send_head(daemon, path)
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    assert status.split(" ")[1] == "413", data[:300]
    assert headers["connection"] == "close" and took < 5
    error = json.loads(body)
    if surface == "anthropic":
        assert error["type"] == "error" and error["error"]["type"] == "request_too_large"
        assert headers["request-id"].startswith("req_")
    elif surface == "ollama":
        assert list(error) == ["error"] and "max_body_bytes" in error["error"]
    else:
        assert error["error"]["code"] == "request_too_large"


def test_oversized_body_with_expect_gets_no_100(daemon: Daemon) -> None:
    data, _ = send_head(daemon, "/v1/chat/completions", "Expect: 100-continue", f"Authorization: Bearer {KEY}")
    assert not data.startswith(b"HTTP/1.1 100") and data.startswith(b"HTTP/1.1 413")


def test_a_body_within_the_limit_still_needs_a_key(daemon: Daemon) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", b"x" * LIMIT, {"content-type": "application/json"})
    assert conn.getresponse().status == 401
    conn.close()


def test_sdk_clients_read_the_413_without_a_key(daemon: Daemon) -> None:
    import anthropic

    # they write the whole body; the daemon answered at the headers and closed,
    # and httpx (under both SDKs) still reads that answer: 413, not 401
    big = "x" * (2 * LIMIT)
    with pytest.raises(openai.APIStatusError) as e:
        openai.OpenAI(
            base_url=f"http://127.0.0.1:{daemon.port}/v1", api_key="wrong", max_retries=0
        ).chat.completions.create(model="tiny", messages=[{"role": "user", "content": big}])
    assert e.value.status_code == 413
    with pytest.raises(anthropic.APIStatusError) as a:
        anthropic.Anthropic(base_url=f"http://127.0.0.1:{daemon.port}", api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=1, messages=[{"role": "user", "content": big}]
        )
    assert a.value.status_code == 413 and cast(dict[str, Any], a.value.body)["error"]["type"] == "request_too_large"
