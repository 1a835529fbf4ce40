"""
What the tests that start real servers of their own (PostgreSQL, Redis,
the daemon) share: a free loopback port, and the failure for a server
that is not installed.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def not_installed(what: str, install: str) -> AssertionError:
    """
    The failure of a test whose server is missing: never a skip (in CI or
    out of it), and it says what to install (`./dev.sh unit` and `test`
    install it where they may).
    """
    return AssertionError(f"{what} not installed: {install}")
