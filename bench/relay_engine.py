#!/usr/bin/env python3
"""
A canned engine that streams as fast as the socket allows: the relay
ceiling's upstream (bench/relay.py). bench/engine_shim.py execs it for the
models named `relay*`, with llama-server's argv (`--host H --port P
--alias NAME ...`; the rest is ignored).

It answers as llama-server does: `GET /health` 200; `POST
/v1/chat/completions` with `"stream": true` an SSE stream of
chat.completion.chunk events (EVENTS of them, then `data: [DONE]`), each
event in a chunk of its own (`Transfer-Encoding: chunked`), announcing
keep-alive and then closing the connection after the stream, as
llama-server does; without `"stream": true` a canned chat.completion;
anything else 404. The events are built once; serving a stream costs one
send per event. Like a batching engine's decode step, each step of the loop
writes the next event of every open stream (a stream whose socket is full
waits for it to drain), so the streams interleave and no stream's events
reach the gateway in one piece unless the gateway falls behind. For the
models named `relay-paced*` the steps come every STEP_S seconds instead of
back to back: a GPU engine's pace, 64 streams x an event each per 2 ms step
= 32,000 chunks/s offered, each event in a read of its own while the
gateway keeps up.

    relay_engine.py --host 127.0.0.1 --port 8080 --alias relay

Standard library only (asyncio), so that any python3 runs it.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from engine_shim import canned  # (bench/, the script's own directory, is on its sys.path)

EVENTS = 100  # data events per stream, [DONE] not counted (engine_shim's CHUNKS)
STEP_S = 0.002  # the paced engine's decode step

HEAD = (
    b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5, max=100\r\nContent-Type: text/event-stream\r\n"
    b"Server: llama.cpp\r\nTransfer-Encoding: chunked\r\nAccess-Control-Allow-Origin: \r\n\r\n"
)


def frame(data: bytes) -> bytes:
    """
    C{data} as one chunk of a chunked body.
    """
    return b"%x\r\n%s\r\n" % (len(data), data)


def replies(alias: str) -> tuple[bytes, list[bytes], bytes]:
    """
    (the whole non-streamed reply, the stream's frames after its head, the
    404 reply).
    """
    reply, stream = canned(alias)
    body = reply.encode()
    whole = (
        b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5, max=100\r\nContent-Type: application/json; charset=utf-8\r\n"
        b"Server: llama.cpp\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    events = [e + "\n\n" for e in stream.split("\n\n") if e]
    frames = [frame(e.encode()) for e in events] + [b"0\r\n\r\n"]
    missing = b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}'
    not_found = b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(missing),
        missing,
    )
    return whole, frames, not_found


HEALTH = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{"status":"ok"}'


class Stream:
    """
    One stream being written: its transport and the next frame's index.
    """

    __slots__ = ("transport", "next", "paused")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.next = 0
        self.paused = False


class Engine:
    """
    The streams being written, one event of each per step.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, alias: str) -> None:
        self.loop = loop
        self.step_s = STEP_S if alias.startswith("relay-paced") else 0.0
        self.whole, self.frames, self.not_found = replies(alias)
        self.streams: list[Stream] = []
        self.stepping = False

    def start(self, transport: asyncio.Transport) -> Stream:
        transport.write(HEAD + self.frames[0])
        stream = Stream(transport)
        stream.next = 1
        self.streams.append(stream)
        if not self.stepping:
            self.stepping = True
            self.next_step()
        return stream

    def step(self) -> None:
        frames, last = self.frames, len(self.frames) - 1
        still = []
        for s in self.streams:
            if s.transport.is_closing():
                continue
            if s.paused:
                still.append(s)
                continue
            s.transport.write(frames[s.next])
            if s.next == last:
                s.transport.close()  # as llama-server does after a stream
            else:
                s.next += 1
                still.append(s)
        self.streams = still
        if still:
            self.next_step()
        else:
            self.stepping = False

    def next_step(self) -> None:
        if self.step_s:
            self.loop.call_later(self.step_s, self.step)
        else:
            self.loop.call_soon(self.step)


class Connection(asyncio.Protocol):
    """
    One client connection: requests parsed by hand (a head, then a
    Content-Length or chunked body), answered in order.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.buffer = b""
        self.stream: Stream | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def pause_writing(self) -> None:
        if self.stream is not None:
            self.stream.paused = True

    def resume_writing(self) -> None:
        if self.stream is not None:
            self.stream.paused = False

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.stream is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
            start = end + 4
            if fields.get("transfer-encoding", "").lower() == "chunked":
                stop = self.buffer.find(b"\r\n0\r\n\r\n", start - 2)
                if stop < 0:
                    return
                body, rest = self.buffer[start:stop], self.buffer[stop + 7 :]
            else:
                length = int(fields.get("content-length", "0"))
                if len(self.buffer) < start + length:
                    return
                body, rest = self.buffer[start : start + length], self.buffer[start + length :]
            self.buffer = rest
            method, _, target = head[0].partition(" ")
            path = target.partition(" ")[0]
            self.answer(method, path, body)

    def answer(self, method: str, path: str, body: bytes) -> None:
        if method == "GET" and path == "/health":
            self.transport.write(HEALTH)
        elif method == "POST" and path == "/v1/chat/completions":
            if b'"stream":true' in body.replace(b" ", b""):
                self.stream = self.engine.start(self.transport)
            else:
                self.transport.write(self.engine.whole)
        else:
            self.transport.write(self.engine.not_found)


async def serve(host: str, port: int, alias: str) -> None:
    loop = asyncio.get_running_loop()
    engine = Engine(loop, alias)
    server = await loop.create_server(lambda: Connection(engine), host, port, backlog=1024, reuse_address=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> None:
    def arg(name: str, default: str) -> str:
        return argv[argv.index(name) + 1] if name in argv else default

    asyncio.run(serve(arg("--host", "127.0.0.1"), int(arg("--port", "8080")), arg("--alias", "relay")))


if __name__ == "__main__":
    main(sys.argv[1:])
