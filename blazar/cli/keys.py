"""
C{blazar keys}: the API keys, through the daemon, which writes changes to
its config file; or, with C{[cluster] database}, to the store every node of
the cluster shares (keys of the config file stay the node's own, and
C{list} marks the shared ones).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from blazar import strictjson
from blazar.cli.daemon import OK, Verbs, control, verb_group

if TYPE_CHECKING:
    from twisted.protocols.amp import AMP


async def every_key(p: AMP) -> list[dict[str, Any]]:
    """
    Every key the daemon lists, asking for C{KeysList}'s pages until the
    last (one answer holds as many keys as fit one AMP value).
    """
    from blazar.protocols.control import KeysList

    keys: list[dict[str, Any]] = []
    offset: int | None = 0
    while offset is not None:
        page = await p.callRemote(KeysList, offset=offset)
        keys += page["keys"]
        offset = page.get("next_offset")
    return keys


def _keys(args: argparse.Namespace) -> int:
    from blazar.protocols.control import KeysAdd, KeysRemove, KeysRotate
    from blazar.protocols.keyadmin import LIMITS

    async def action(p: AMP) -> int:
        if args.keys_verb == "list":
            keys = await every_key(p)
            if args.json:
                print(strictjson.encode(keys))
            elif not keys:
                print("no keys: the gateway is open (add one with `blazar keys add NAME`)")
            for k in keys if not args.json else []:
                where = "shared" if k.get("shared") else "config"
                models = ", ".join(k["models"]) or "(all models, admin)"
                if k.get("models_left_out"):
                    models += f" (and {k['models_left_out']} more)"
                print(f"{k['name']:<24} {k['secret']:<10} {where:<7} {models}")
        elif args.keys_verb == "add":
            limits = {f: getattr(args, f) for f in LIMITS if getattr(args, f, None) is not None}
            added = await p.callRemote(KeysAdd, name=args.name, models=args.models or [], **limits)
            where = " (shared by every node of the cluster)" if added.get("shared") else ""
            print(f"added key {args.name!r}{where}; its secret, shown only now:\n{added['secret']}")
        elif args.keys_verb == "rotate":
            rotated = await p.callRemote(KeysRotate, name=args.name)
            every = " on every node within seconds" if rotated.get("shared") else ""
            print(
                f"rotated key {args.name!r}; the old secret no longer works{every}. New secret, shown only now:\n"
                f"{rotated['secret']}"
            )
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
        "API keys (written to the daemon's config file; with [cluster] database, shared by every node)",
        _keys,
        [
            ("list", "keys, secrets redacted", []),
            ("add", "a new key; prints its secret once", ["name"]),
            ("rotate", "a new secret for a key; prints it once", ["name"]),
            ("rm", "remove a key", ["name"]),
        ],
        {"add": _add_options},
    )


def _add_options(verb: argparse.ArgumentParser) -> None:
    verb.add_argument(
        "--model",
        dest="models",
        action="append",
        help="scope the key to this model (repeatable); none: all models + admin",
    )
    verb.add_argument("--rpm", type=int, help="requests per minute (default: no limit)")
    verb.add_argument("--tpm", type=int, help="tokens per minute (default: no limit)")
    verb.add_argument("--daily-tokens", dest="daily_tokens", type=int, help="tokens per UTC day (default: no limit)")
    verb.add_argument(
        "--max-concurrent", dest="max_concurrent", type=int, help="its requests running at once (default: no limit)"
    )
    verb.add_argument("--weight", type=float, help="its share of a busy model's slots (default: 1)")
