"""
What the C{blazar} verbs share: the exit codes, the reactor run of a
verb's async work, the AMP connection to the daemon's control socket,
the daemon's HTTP API (for C{run}, C{models pull}, C{bench}, C{logs -f})
and the parser of a verb that talks to the daemon.

Heavy imports (Twisted, treq, C{http.client}, the rest of Blazar) are made
inside the functions that use them, here and in every verb module: the
package is imported by every C{blazar} command, and C{blazar --help} or a
usage error should not wait a third of a second for AMP and the config
parser. None of them hides an import circle (C{blazar.cli} is the top
layer; nothing imports it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.parse
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, TypeAlias

from blazar import strictjson

if TYPE_CHECKING:
    from twisted.protocols.amp import AMP

    from blazar.config import Config

OK = 0
ERROR = 1
NO_DAEMON = 2
"""
No daemon answers on the control socket or the HTTP API. (C{serve} exits 3
when its port is taken: L{blazar.service.EXIT_BIND_CONFLICT}.)
"""
USAGE = 2
"""
A command line refused: argparse's own code, and C{models make-test}'s for
a shape the generator cannot make.
"""

Verbs: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""
The type of the parser's C{add_subparsers()}, which each verb module's
C{add_verbs} adds its verbs to (a string: argparse's class is private).
"""

Action: TypeAlias = Callable[["AMP"], Awaitable[int]]
"""
A verb's work over the control socket: given the connected protocol, its
exit code.
"""


def run_reactor(main: Callable[[Any], Awaitable[int]]) -> int:
    """
    Run C{main(reactor)} under L{twisted.internet.task.react} and return
    the exit code it returns; L{ERROR} if it raises (react logs the
    failure).
    """
    from twisted.internet.defer import Deferred
    from twisted.internet.task import react

    outcome = {"code": ERROR}

    async def run(reactor: Any) -> None:
        outcome["code"] = await main(reactor)

    try:
        react(lambda r: Deferred.fromCoroutine(run(r)))
    except SystemExit:
        pass
    return outcome["code"]


def control(args: argparse.Namespace, action: Action) -> int:
    """
    Connect to the daemon's control socket, check the protocol version, run
    C{action(protocol)} and return its exit code; L{NO_DAEMON} with a
    one-line explanation if no daemon answers.
    """
    from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
    from twisted.protocols.amp import AMP, RemoteAmpError

    from blazar.config import ConfigError, resolve_config
    from blazar.protocols.control import (
        PROTOCOL_VERSION,
        BenchError,
        ClusterError,
        IncompatibleClient,
        KeyError_,
        ModelError,
        NothingToEvict,
        UnknownModel,
        Version,
    )

    try:
        config = resolve_config(args.config)
    except ConfigError as e:
        print(f"blazar: {e}", file=sys.stderr)
        return ERROR
    path = config.data_dir / "run" / "control.sock"

    async def main(reactor: Any) -> int:
        try:
            protocol = await connectProtocol(UNIXClientEndpoint(reactor, str(path), timeout=5), AMP())
        except Exception:
            print(
                f"blazar: no daemon is running for data_dir {config.data_dir} "
                f"(no answer on {path}); start one with `blazar serve`",
                file=sys.stderr,
            )
            return NO_DAEMON
        try:
            await protocol.callRemote(Version, protocol=PROTOCOL_VERSION)
            return await action(protocol)
        except RemoteAmpError as e:
            print(f"blazar: {e.description}", file=sys.stderr)
            return ERROR
        except (NothingToEvict, IncompatibleClient, ModelError, UnknownModel, KeyError_, BenchError, ClusterError) as e:
            print(f"blazar: {e}", file=sys.stderr)
            return ERROR
        finally:
            # gone already when the reactor stopped under a suspended verb (Ctrl-C on `logs -f`)
            if protocol.transport is not None:
                protocol.transport.loseConnection()

    return run_reactor(main)


def one_call(args: argparse.Namespace, command: Any, say: Callable[[Any], str], **arguments: Any) -> int:
    """
    Send one control command and print C{say(answer)}.
    """

    async def action(p: AMP) -> int:
        print(say(await p.callRemote(command, **arguments)))
        return OK

    return control(args, action)


def http_base(config: Config) -> str | None:
    """
    An http://host:port for the daemon's first TCP listener, if it has one.
    """
    for description in config.listen:
        m = re.match(r"tcp:(\d+)(?::interface=([^:]+))?", description)
        if m:
            host = m[2] or "127.0.0.1"
            if host in ("0.0.0.0", "::"):
                host = "127.0.0.1"
            return f"http://{host}:{m[1]}"
    return None


def daemon_http(args: argparse.Namespace, verb: str) -> tuple[str, int, str] | int:
    """
    The (host, port, base URL) of the daemon's HTTP API from its config, or
    an exit code after explaining why there is none.
    """
    from blazar.config import ConfigError, resolve_config

    try:
        config = resolve_config(args.config)
    except ConfigError as e:
        print(f"blazar: {e}", file=sys.stderr)
        return ERROR
    base = http_base(config)
    if base is None:
        print(f"blazar {verb}: the daemon has no tcp: listener in `listen`", file=sys.stderr)
        return ERROR
    url = urllib.parse.urlparse(base)
    return url.hostname or "127.0.0.1", url.port or 11434, base


def post_ndjson(
    host: str,
    port: int,
    base: str,
    path: str,
    body: Any,
    timeout: float,
    key: str | None = None,
) -> Any:
    """
    POST to the daemon's Ollama API; the response (to read as NDJSON) on
    200, else an exit code after printing why (L{NO_DAEMON}: no daemon
    answers).

    @param key: An API key to send (C{--key}, else C{BLAZAR_API_KEY}): a
        gateway with keys needs one.
    """
    import http.client

    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    try:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        conn.request("POST", path, strictjson.encode(body), headers)
        resp = conn.getresponse()
    except OSError:
        print(f"blazar: no daemon answers on {base}; start one with `blazar serve`", file=sys.stderr)
        return NO_DAEMON
    if resp.status != 200:
        try:
            message = json.loads(resp.read()).get("error", "")
        except ValueError:
            message = f"HTTP {resp.status}"
        if resp.status == 401:
            # (the gateway's own hint is for HTTP clients; this is the CLI's)
            message = (
                f"{message}; this command sends the key given with --key or in $BLAZAR_API_KEY"
                if not key
                else f"{message}; the key given (--key or $BLAZAR_API_KEY) was refused"
            )
        print(f"blazar: {message}", file=sys.stderr)
        return ERROR
    return resp


def api_key(args: argparse.Namespace) -> str | None:
    """
    The API key for the verbs that use the HTTP API (C{run}, C{models
    pull}, C{bench}): C{--key}, else the C{BLAZAR_API_KEY} environment
    variable.
    """
    return getattr(args, "key", None) or os.environ.get("BLAZAR_API_KEY") or None


def daemon_verb(
    verbs: Verbs, name: str, help: str, func: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """
    Add a verb that asks the running daemon: it takes C{--config} (to
    find the daemon's data_dir) and C{--json}.
    """
    v = verbs.add_parser(name, help=help)
    v.add_argument("--config", "-c", help="config.toml of the daemon (to find its data_dir)")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.set_defaults(func=func)
    return v


def verb_group(
    verbs: Verbs,
    name: str,
    help: str,
    func: Callable[[argparse.Namespace], int],
    rows: list[tuple[str, str, list[str]]],
    flags: Mapping[str, Callable[[argparse.ArgumentParser], object]],
    config_help: str | None = None,
) -> None:
    """
    Add C{name}, a verb of verbs (C{blazar engine list}, C{blazar keys
    add}): one per row of C{rows} (its name, help and positional
    arguments), each with its own flags (C{flags[name]}, if any), then
    C{--config} and C{--json}. C{func} runs them all and tells them apart
    by C{args.<name>_verb}.
    """
    group = verbs.add_parser(name, help=help)
    group_verbs = group.add_subparsers(dest=f"{name}_verb", required=True)
    for verb_name, verb_help, params in rows:
        verb = group_verbs.add_parser(verb_name, help=verb_help)
        for param in params:
            verb.add_argument(param)
        if verb_name in flags:
            flags[verb_name](verb)
        verb.add_argument("--config", "-c", help=config_help)
        verb.add_argument("--json", action="store_true")
        verb.set_defaults(func=func)
