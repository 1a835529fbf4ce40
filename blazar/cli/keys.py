"""
C{blazar keys}: the API keys, through the daemon, which writes changes to
its config file.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from blazar import strictjson
from blazar.cli.daemon import OK, Verbs, control, verb_group

if TYPE_CHECKING:
    from twisted.protocols.amp import AMP


def _keys(args: argparse.Namespace) -> int:
    from blazar.protocols.control import KeysAdd, KeysList, KeysRemove, KeysRotate

    async def action(p: AMP) -> int:
        if args.keys_verb == "list":
            keys = (await p.callRemote(KeysList))["keys"]
            if args.json:
                print(strictjson.encode(keys))
            elif not keys:
                print("no keys: the gateway is open (add one with `blazar keys add NAME`)")
            for k in keys if not args.json else []:
                print(f"{k['name']:<24} {k['secret']:<10} {', '.join(k['models']) or '(all models, admin)'}")
        elif args.keys_verb == "add":
            secret = (await p.callRemote(KeysAdd, name=args.name, models=args.models or []))["secret"]
            print(f"added key {args.name!r}; its secret, shown only now:\n{secret}")
        elif args.keys_verb == "rotate":
            secret = (await p.callRemote(KeysRotate, name=args.name))["secret"]
            print(f"rotated key {args.name!r}; the old secret no longer works. New secret, shown only now:\n{secret}")
        else:
            await p.callRemote(KeysRemove, name=args.name)
            print(f"removed key {args.name!r}")
        return OK

    return control(args, action)


def add_verbs(verbs: Verbs) -> None:
    """
    Add C{keys} and its verbs to the parser.
    """
    verb_group(
        verbs,
        "keys",
        "API keys (written to the daemon's config file)",
        _keys,
        [
            ("list", "keys, secrets redacted", []),
            ("add", "a new key; prints its secret once", ["name"]),
            ("rotate", "a new secret for a key; prints it once", ["name"]),
            ("rm", "remove a key", ["name"]),
        ],
        {
            "add": lambda verb: verb.add_argument(
                "--model",
                dest="models",
                action="append",
                help="scope the key to this model (repeatable); none: all models + admin",
            ),
        },
    )
