"""
The dashboard's guards that need no browser: a keyless gateway's
management only from this machine's own pages (no cross-site page, no
DNS-rebound name), a followed log stream that never buffers for a reader
that does not read, key names, and the config's .bak copies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.web.iweb import IRequest
from twisted.web.test.requesthelper import DummyRequest

from blazar.config import Config
from blazar.gateway.errors import Forbidden
from blazar.gateway.operations import ModelOperations
from blazar.gateway.pipeline import Pipeline
from blazar.models.registry import ModelRegistry
from blazar.web.auth import check_same_machine_page


def bare_dashboard(clock: Clock) -> Any:
    """
    A dashboard with nothing behind it (what these guards need is its own).
    """
    from blazar.web.dashboard import Dashboard

    return Dashboard(
        cast(ModelRegistry, None),
        cast(Pipeline, None),
        cast(ModelOperations, None),
        clock,
        lambda: 0.0,
        lambda: cast(Config, None),
    )


def request_with(**headers: str) -> DummyRequest:
    r = DummyRequest([b""])
    for name, value in headers.items():
        r.requestHeaders.setRawHeaders(name.encode(), [value.encode()])
    return r


@pytest.mark.parametrize(
    "headers",
    [
        {"host": "127.0.0.1:11434"},
        {"host": "localhost:11434", "origin": "http://localhost:11434"},
        {"host": "[::1]:11434", "origin": "http://127.0.0.1:11434"},
        {},
    ],
)
def test_this_machines_pages_and_tools_pass(headers: dict[str, str]) -> None:
    check_same_machine_page(cast(IRequest, request_with(**headers)), host_too=True)


@pytest.mark.parametrize(
    "headers",
    [
        {"host": "127.0.0.1:11434", "origin": "https://evil.example"},  # another site's page (CSRF)
        {"host": "evil.example:11434"},  # a rebound name
        {"host": "127.0.0.1:11434", "origin": "null"},  # a sandboxed page or a file
        {"host": "127.0.0.1.evil.example:11434"},
        {"host": "localhost:11434", "origin": "http://127.0.0.1.evil.example"},
    ],
)
def test_other_sites_pages_and_rebound_names_are_refused(headers: dict[str, str]) -> None:
    with pytest.raises(Forbidden, match="no API keys"):
        check_same_machine_page(cast(IRequest, request_with(**headers)), host_too=True)


def test_management_checks_the_origin_and_the_dashboard_the_host_too() -> None:
    check_same_machine_page(cast(IRequest, request_with(host="blazar")))  # a tool under its own name: no Origin, fine
    with pytest.raises(Forbidden):
        check_same_machine_page(cast(IRequest, request_with(host="blazar")), host_too=True)
    check_same_machine_page(
        cast(IRequest, request_with(host="10.0.0.5:11434")), host_too=True
    )  # an address is never rebound


class Transport:
    def __init__(self) -> None:
        self.aborted = False

    def abortConnection(self) -> None:
        self.aborted = True


class Channel:
    def __init__(self) -> None:
        self.transport = Transport()


class StreamRequest:
    """
    What the log stream touches of a request: writes, its producer, its end.
    """

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.headers: dict[bytes, bytes] = {}
        self.producer: Any = None
        self.channel = Channel()
        self.ended: Deferred[None] = Deferred()

    def setHeader(self, name: bytes, value: bytes) -> None:
        self.headers[name] = value

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None

    def notifyFinish(self) -> Deferred[None]:
        return self.ended


def test_a_follower_that_does_not_read_gets_nothing_queued_and_is_dropped() -> None:
    from blazar.web.dashboard import LOG_STALL

    clock = Clock()
    dash = bare_dashboard(clock)
    ring: list[dict[str, Any]] = [{"seq": 1, "model": "m", "text": "one"}]
    request = StreamRequest()
    done = dash._follow(cast(IRequest, request), lambda since: [r for r in ring if r["seq"] > since], 0, "k")
    clock.advance(0)
    assert b"one" in b"".join(request.written) and dash._streams == {"k": 1}
    request.producer.pauseProducing()  # its socket's buffer is full
    sent = len(request.written)
    ring += [{"seq": n, "model": "m", "text": "x" * 1000} for n in range(2, 500)]
    clock.advance(1)
    assert len(request.written) == sent, "lines were written to a paused follower"
    request.producer.resumeProducing()
    clock.advance(0.3)
    assert len(request.written) > sent  # what the ring holds, once it drains
    request.producer.pauseProducing()
    clock.advance(LOG_STALL + 1)
    assert request.channel.transport.aborted and done.called and dash._streams == {}
    assert request.producer is None  # unregistered before the handler's end finishes the request


def test_a_follower_that_leaves_unregisters_the_producer() -> None:
    # else Twisted refuses to finish the request: "Producer was not unregistered" (a critical log line)

    clock = Clock()
    dash = bare_dashboard(clock)
    request = StreamRequest()
    done = dash._follow(cast(IRequest, request), lambda since: [], 0, "k")
    clock.advance(0)
    assert request.producer is not None
    request.ended.errback(Exception("connection lost"))
    assert done.called and request.producer is None and dash._streams == {}


def test_key_names_are_checked_where_keys_are_made(tmp_path: Path) -> None:
    from blazar.config import ConfigError, LiveConfig, parse_config
    from blazar.protocols.keyadmin import KeyAdmin

    admin = KeyAdmin(tmp_path / "c.toml", LiveConfig(parse_config("")), Clock())
    for bad in ("nl\nname", "nul\x00byte", "slash/name", "x" * 65, "", "sp ace"):
        with pytest.raises(ConfigError, match="a key's name"):
            admin.add(bad, [])
    planned = admin.add("ok-name_1.2", [])
    assert isinstance(planned, tuple)  # (no cluster: a change to the config file)
    mutate, result = planned
    assert result["secret"].startswith("blz-")


def test_the_config_keeps_its_newest_backups(tmp_path: Path) -> None:
    import os

    from blazar.config import BACKUPS, thd_rewrite

    path = tmp_path / "c.toml"
    path.write_text("# keys\n")
    for n in range(BACKUPS + 4):
        thd_rewrite(path, lambda doc, n=n: doc.__setitem__("keep_alive", f"{n + 1}m"))
        for b in tmp_path.glob("c.toml.*.bak"):  # distinct mtimes, oldest first
            os.utime(b, ns=(b.stat().st_mtime_ns, b.stat().st_mtime_ns))
    assert len(list(tmp_path.glob("c.toml.*.bak"))) == BACKUPS
    assert 'keep_alive = "9m"' in path.read_text()


def test_a_key_change_the_config_file_refuses_names_no_server_path() -> None:
    from twisted.internet.defer import ensureDeferred

    from blazar.gateway.errors import Unavailable

    class Admin:
        async def change(self, plan: Any) -> dict[str, Any]:
            raise PermissionError(13, "Permission denied", "/etc/blazar/.config.toml.tmp")

    dash = bare_dashboard(Clock())
    dash.key_admin = cast(Any, Admin())
    failure = ensureDeferred(dash._change(cast(IRequest, request_with()), lambda admin: None))
    errors: list[Any] = []
    failure.addErrback(errors.append)
    (error,) = errors
    assert error.check(Unavailable), error
    assert "/etc/blazar" not in str(error.value) and "config file" in str(error.value)
