"""
What every L{blazar.engines.client.IEngineClient} does, checked on the
fake most tests use (L{blazar.testing.StubEngineClient} over
L{blazar.testing.fake_engine_app}: tests/engines/test_engine_client_contract.py)
and on the real L{blazar.engines.client.EngineClient} against a real
llama-server (tests/integration/test_engine_client_e2e.py).
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from blazar.engines.client import IEngineClient
from blazar.httpbody import BodyTooLarge

CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}


async def check_engine_client(
    client: Any,
    base_url: str,
    headers: dict[bytes, list[bytes]],
    read: Callable[[Any], Awaitable[bytes]],
) -> None:
    """
    @param base_url: The engine's root (C{http://127.0.0.1:PORT}).
    @param headers: What the engine demands of every request (its key).
    @param read: The whole body of a response C{request} returned.
    """
    assert IEngineClient.providedBy(client)
    sent = {**headers, b"content-type": [b"application/json"]}
    url = base_url + "/v1/chat/completions"

    # a non-streamed answer: headers first, then the OpenAI JSON
    response = await client.request("POST", url, json.dumps({**CHAT, "stream": False}).encode(), sent, stream=False)
    assert response.code == 200, response.code
    assert response.headers.getRawHeaders(b"content-type")[0].startswith(b"application/json")
    answer = json.loads(await read(response))
    assert answer["object"] == "chat.completion", answer
    assert answer["choices"][0]["message"]["role"] == "assistant", answer
    assert answer["usage"]["completion_tokens"] >= 1, answer

    # a streamed answer: SSE chunks, then [DONE]
    response = await client.request("POST", url, json.dumps({**CHAT, "stream": True}).encode(), sent, stream=True)
    assert response.code == 200, response.code
    assert response.headers.getRawHeaders(b"content-type")[0].startswith(b"text/event-stream")
    events = [
        line[len("data: ") :] for line in (await read(response)).decode().splitlines() if line.startswith("data: ")
    ]
    assert events and events[-1] == "[DONE]", events
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks and all(chunk["object"] == "chat.completion.chunk" for chunk in chunks), chunks

    # GETs: the status of a route the engine lacks, with its body; get_status is get's status
    missing = base_url + "/no-such-route"
    status, body = await client.get(missing, headers)
    assert status == 404 and body, (status, body)
    assert await client.get_status(missing) == (await client.get(missing, {}))[0]
    try:
        await client.get(missing, headers, max_bytes=len(body) - 1)
    except BodyTooLarge:
        pass
    else:
        raise AssertionError("a body over max_bytes was not refused")

    await client.close()
