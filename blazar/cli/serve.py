"""
C{blazar serve}: the daemon in the foreground, under twistd.
"""

from __future__ import annotations

import argparse
import sys

from blazar.cli.daemon import ERROR, OK, Verbs


def _serve(args: argparse.Namespace) -> int:
    import os

    from twisted.scripts.twistd import run

    from blazar.config import ConfigError
    from blazar.service import thd_startup_config

    # the config's checks first, here: twistd would print its own usage block above a config error
    # (read as a command-line mistake); the draft models' vocabularies are remembered for twistd's pass
    try:
        thd_startup_config(args.config, os.environ)
    except ConfigError as e:
        print(f"blazar serve: {e}", file=sys.stderr)
        return ERROR

    # blazar.logtext: the same log lines as twistd's own observer, made at a
    # sixth of its cost
    argv = ["twistd", "--nodaemon", "--pidfile=", "--logger=blazar.logtext.observer", "blazar"]
    if args.config:
        argv += ["--config", args.config]
    sys.argv = argv
    run()
    return OK


def add_verbs(verbs: Verbs) -> None:
    """
    Add C{serve} to the parser.
    """
    serve = verbs.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--config", "-c", help="config.toml (default: $BLAZAR_CONFIG or ~/.config/blazar/config.toml)")
    serve.set_defaults(func=_serve)
