"""
A stand-in for llama-server that keeps connections alive (as it says it
does), but closes each kept connection, unanswered, when a second request
arrives on it: the race of a child closing an idle connection just as
Blazar reuses it. Used as [engines.llamacpp] binary.
"""

import json
import socket
import sys
import threading


def read_request(conn: socket.socket, buffered: bytes) -> tuple[bytes, bytes] | None:
    data = buffered
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        rest += chunk
    return head, rest[length:]


def serve(conn: socket.socket, alias: str) -> None:
    first = read_request(conn, b"")
    if first is None:
        conn.close()
        return
    head, rest = first
    if head.startswith(b"GET /health"):
        body = b'{"status":"ok"}'
    else:
        body = json.dumps(
            {
                "choices": [{"finish_reason": "stop", "index": 0, "message": {"role": "assistant", "content": "ok"}}],
                "created": 1,
                "model": alias,
                "object": "chat.completion",
                "id": "x",
                "usage": {"completion_tokens": 1, "prompt_tokens": 1, "total_tokens": 2},
            },
            separators=(",", ":"),
        ).encode()
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nKeep-Alive: timeout=5, max=100\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    if read_request(conn, rest) is not None:
        print("closed a kept connection under a request", file=sys.stderr, flush=True)
    conn.close()


def main() -> None:
    argv = sys.argv
    port = int(argv[argv.index("--port") + 1])
    alias = argv[argv.index("--alias") + 1]
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(64)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn, alias), daemon=True).start()


if __name__ == "__main__":
    main()
