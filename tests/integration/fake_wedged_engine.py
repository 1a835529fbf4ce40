"""
A stand-in for llama-server that loads, answers /health once, then hangs:
it keeps accepting connections but never answers anything again.
Used as [engines.llamacpp] binary by the wedged-child test.
"""

import socket
import sys
import time


def main() -> None:
    argv = sys.argv
    port = int(argv[argv.index("--port") + 1])
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(16)
    answered = False
    held = []
    while True:
        conn, _ = server.accept()
        if not answered:
            conn.recv(65536)
            conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 15\r\nConnection: close\r\n\r\n{"status":"ok"}')
            conn.close()
            answered = True
        else:
            held.append(conn)  # accepted, never answered
        time.sleep(0.01)


if __name__ == "__main__":
    main()
