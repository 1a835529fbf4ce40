"""
The configuration reference, C{docs/config-reference.md}, written from the
keys' declarations (L{blazar.config.declare.setting}): every key, what it
takes, its default, what C{blazar reload} does with it, and what it does.

C{python -m blazar.config --reference > docs/config-reference.md} rewrites
the file; C{tests/test_config_reference.py} fails while the committed file
and L{markdown} differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import attrs
import tomlkit

from blazar.config import (
    DEFAULT_CONFIG_PATH,
    CacheConfig,
    ClusterConfig,
    CommandLane,
    Config,
    KeyConfig,
    LlamaCppConfig,
    ModelConfig,
    QueueConfig,
    RemoteConfig,
)
from blazar.config.declare import RESTART, Key, declared

REGENERATE = "python -m blazar.config --reference > docs/config-reference.md"

_INTRO = f"""\
# Configuration reference

<!-- Written by `{REGENERATE}` from the keys'
declarations in blazar/config/; edit those, not this file (a unit test fails while they differ). -->

One optional TOML file: `--config PATH`, else `$BLAZAR_CONFIG`, else `{DEFAULT_CONFIG_PATH}`.
Every key has a default, so no file is needed to serve. An unknown key or a wrong type stops the
daemon at start (exit code 1) with a message naming the key and the file; `blazar reload` (or
SIGHUP) refuses such a file and keeps the running config.

**Reload** says what `blazar reload` and SIGHUP do with a changed key: *live*, the running daemon
uses the new value from then on (read per request, per stream, or at a model's next start);
*restart*, only a restart applies it (the daemon keeps the old value, and names the key at every
reload until it restarts)."""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _toml(value: Any) -> str:
    """
    A default as the file would write it.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return tomlkit.string(str(value)).as_string()
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}: declare it with shown=")


def _default(field: attrs.Attribute[Any], key: Key) -> str:
    if key.shown is not None:
        return key.shown
    if field.default is attrs.NOTHING:
        return "required"
    if field.default is None:
        return "unset"
    return f"`{_toml(field.default)}`"


def _is_table(field: attrs.Attribute[Any]) -> bool:
    return attrs.has(type(field.default))


_Item = tuple["attrs.Attribute[Any]", Key]


def _keys(cls: type, under: str = "") -> list[_Item]:
    """
    C{cls}'s keys read from the file (not its tables), those named under
    table C{under} (C{engines.}) alone when given, their names without it.
    """
    return [
        (field, attrs.evolve(key, name=key.name.removeprefix(under)))
        for field, key in declared(cls)
        if key.in_file
        and key.value is not None
        and not _is_table(field)
        and key.name.startswith(under)
        and "." not in key.name.removeprefix(under)
    ]


def _section(title: str, doc: str, items: list[_Item], reload: str = "") -> Iterator[str]:
    """
    A heading, its words, and a Markdown table of its keys, in groups.
    """
    yield from ("", f"## {title}", "", doc)
    groups: dict[str, list[str]] = {}
    for field, key in items:
        assert key.value is not None
        kind = "restart" if RESTART in (key.reload, reload) else "live"
        groups.setdefault(key.group, []).append(
            f"| `{key.name}` | {_cell(key.value.what)} | {_cell(_default(field, key))} | {kind} | {_cell(key.doc)} |"
        )
    for group, rows in groups.items():
        if group:
            yield from ("", f"### {group[0].upper()}{group[1:]}")
        yield from ("", "| key | takes | default | reload | what it does |")
        yield "|---|---|---|---|---|"
        yield from rows


def markdown() -> str:
    """
    The whole reference, as C{docs/config-reference.md} holds it.
    """
    top = {field.name: key for field, key in declared(Config)}
    builtins = [key for field, key in declared(Config) if isinstance(field.default, LlamaCppConfig)]
    lines = [_INTRO]
    lines += _section("Top level", "Keys outside any table.", _keys(Config))
    for name, cls in [("queue", QueueConfig), ("cache", CacheConfig), ("cluster", ClusterConfig)]:
        lines += _section(f"`[{name}]`", top[name].doc, _keys(cls), top[name].reload)
    lines += _section(
        "`[engines]`",
        "Settings of the engines; its tables are the built-in engines and the command lanes (below).",
        _keys(Config, under="engines."),
    )
    lines += _section(
        ", ".join(f"`[{key.name}]`" for key in builtins),
        "The built-in engines, the same two keys in each: "
        + "; ".join(f"`{key.name.split('.')[1]}`, {key.doc.rstrip('.')}" for key in builtins)
        + ".",
        _keys(LlamaCppConfig),
        builtins[0].reload,
    )
    lines += _section(
        "`[engines.NAME]`: command lanes",
        top["lanes"].doc + ' NAME is letters, digits, `-` and `_`; a model takes the lane with `engine = "NAME"`.',
        _keys(CommandLane),
        top["lanes"].reload,
    )
    lines += _section(
        '`[models."NAME"]`',
        top["models"].doc + " A reload applies a changed model at its next "
        "start. The launch profile's keys, unset, leave llama-server's own default.",
        _keys(ModelConfig),
        top["models"].reload,
    )
    lines += _section(
        "`[[keys]]`",
        top["keys"].doc + " With at least one key, every request but `/health`, `/healthz` and `GET /` needs one.",
        _keys(KeyConfig),
        top["keys"].reload,
    )
    lines += _section("`[[remotes]]`", top["remotes"].doc, _keys(RemoteConfig), top["remotes"].reload)
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    """
    C{python -m blazar.config --reference}: print the reference.
    """
    if argv != ["--reference"]:
        print(f"usage: {REGENERATE}")
        return 2
    print(markdown(), end="")
    return 0
