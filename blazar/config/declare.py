"""
How a config key is declared: once, as the attrs field that holds its value.

Each field of L{blazar.config.Config} and of its tables' classes is made by
L{setting}, which stores a L{Key} in the field's metadata: the key's name in
the file, what it takes (a L{Value}: the words that the error message and the
reference use, and the check that turns the file's value into the field's),
whether C{blazar reload} applies it, and its documentation. The parser, the
reload report, the unknown-key messages and the reference
(C{python -m blazar.config --reference}) all read these declarations; no other
place lists the keys.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypeVar

import attrs

RUNTIME = "runtime"
RESTART = "restart"

_T = TypeVar("_T")


class ConfigError(Exception):
    """
    The configuration cannot be used.

    The message names the file, the key and what was expected, so that the
    operator can fix it without reading code.
    """


@attrs.frozen
class At:
    """
    Where a value being parsed stands: for error messages and relative paths.

    @ivar where: The file (or C{<config>}), as messages name it.
    @ivar key: The key's full name, dotted under its tables
        (C{queue.max_waiting}, C{models.a.ctx_size}, C{keys[0].rpm}).
    @ivar base: The directory relative paths are under (C{models_dir}), or
        L{None} where paths stay as written.
    """

    where: str
    key: str
    base: Path | None = None

    def expected(self, what: str, got: object) -> ConfigError:
        """
        The error for a value that is not C{what}.
        """
        return expected(self.where, self.key, what, got)


@attrs.frozen
class Value:
    """
    What a key takes.

    @ivar what: Its values in words (C{"a positive number of seconds"}):
        the error message's C{must be ...} and the reference's column.
    @ivar convert: The file's value to the field's. It raises L{ValueError}
        (or L{TypeError}) for a value that is not C{what}, which becomes
        the message C{<file>: key '<key>' must be <what>, got <type>
        <value>}; or a L{ConfigError} of its own for other mistakes.
    """

    what: str
    convert: Callable[[Any, At], Any]

    def parse(self, raw: object, at: At) -> Any:
        try:
            return self.convert(raw, at)
        except (ValueError, TypeError):
            raise at.expected(self.what, raw) from None


@attrs.frozen
class Key:
    """
    One config-file key, declared once (L{setting}).

    @ivar name: Its name in the file, under its table: C{idle_timeout_secs}
        at the top, C{max_waiting} in C{[queue]}; dotted where a top-level
        field lives in a table (C{engines.gate_max_slowdown}).
    @ivar value: What it takes; L{None} for what a section's own parser reads
        (the tables of many: models, keys, remotes, lanes) or what is not
        read from the file at all (C{source}).
    @ivar reload: L{RUNTIME}: C{blazar reload} (SIGHUP) applies it to the
        running daemon; L{RESTART}: only a restart does.
    @ivar doc: What it does, for the reference.
    @ivar shown: Its default as the reference writes it, where the field's
        default does not say it (C{"5m"}, C{<data_dir>/models}).
    @ivar group: A heading in the reference (C{launch profile}).
    @ivar in_file: False for a field that no file sets (C{source}).
    """

    name: str
    value: Value | None
    reload: str = RUNTIME
    doc: str = ""
    shown: str | None = None
    group: str = ""
    in_file: bool = True


def setting(
    default: _T,
    *,
    value: Value | None,
    doc: str,
    key: str | None = None,
    reload: str = RUNTIME,
    shown: str | None = None,
    group: str = "",
    in_file: bool = True,
    repr: bool = True,
) -> _T:
    """
    An attrs field declaring a config key (L{Key}).

    @param default: The field's default (an C{attrs.Factory} for a new
        object each time), or C{attrs.NOTHING} for a key that must be given.
    @param key: Its name in the file; the field's name when not given.
    """
    declared = Key(key or "", value, reload, doc, shown, group, in_file)
    return attrs.field(default=default, repr=repr, metadata={"key": declared})


def required(*, value: Value, doc: str, key: str | None = None, repr: bool = True) -> Any:
    """
    An attrs field declaring a config key that has no default: a table
    without it is refused with what it takes.
    """
    return attrs.field(repr=repr, metadata={"key": Key(key or "", value, RUNTIME, doc)})


def declared(cls: type) -> Iterator[tuple[attrs.Attribute[Any], Key]]:
    """
    The fields of attrs class C{cls} and their L{Key}s, in field order (the
    file name filled in: the field's own name where the declaration gave
    none).
    """
    for field in attrs.fields(cls):
        key = field.metadata.get("key")
        if key is not None:
            yield field, key if key.name else attrs.evolve(key, name=field.name)


def file_key(cls: type, field_name: str) -> str:
    """
    The file's name of C{cls}'s field C{field_name}.
    """
    for field, key in declared(cls):
        if field.name == field_name:
            return key.name
    raise KeyError(field_name)


def known_keys(cls: type) -> set[str]:
    """
    The keys a table of C{cls} may hold (the first part of dotted ones).
    """
    return {key.name.split(".")[0] for _, key in declared(cls) if key.in_file}


def parse_fields(
    cls: type, table_: Mapping[str, Any], where: str, prefix: str, base: Path | None = None
) -> dict[str, Any]:
    """
    Every key of C{cls} with a L{Value} that C{table} holds, parsed: the
    keyword arguments for C{cls} (its defaults fill in the rest). A key that
    must be given (no default) and is missing is parsed as L{None}, so that
    its message says what it takes.

    @param table_: The table, a dict of the file's values.
    @param prefix: The table's name as messages give it (C{"queue."}).
    """
    out: dict[str, Any] = {}
    for field, key in declared(cls):
        if key.value is None:
            continue
        holder, name = table_, key.name
        while "." in name:  # a field kept in a table of its own: engines.gate_max_slowdown
            section, _, name = name.partition(".")
            holder = table(holder.get(section, {}), where, prefix + section)
        if name in holder:
            raw = holder[name]
        elif field.default is attrs.NOTHING:
            raw = None
        else:
            continue
        out[field.name.lstrip("_")] = key.value.parse(raw, At(where, prefix + key.name, base))
    return out


def unknown(table: Mapping[str, Any], known: set[str], source: str, prefix: str) -> None:
    """
    @raise ConfigError: C{table} holds a key outside C{known}; the message
        lists the known ones.
    """
    for key in table:
        if key not in known:
            raise ConfigError(
                f"{source}: unknown key {prefix + key!r}; "
                f"expected one of: {', '.join(sorted(prefix + k for k in known))}"
            )


def expected(source: str, key: str, what: str, got: object) -> ConfigError:
    return ConfigError(f"{source}: key {key!r} must be {what}, got {type(got).__name__} {got!r}")


def table(value: object, source: str, key: str) -> Mapping[str, Any]:
    """
    @raise ConfigError: C{value} is not a TOML table.
    """
    if not isinstance(value, dict):
        raise expected(source, key, "a table", value)
    return value


def path(value: object, source: str, key: str, base: Path | None = None) -> Path:
    """
    A path key: C{~} expanded, relative ones under C{base} when given.
    """
    if not isinstance(value, str) or not value:
        raise expected(source, key, "a non-empty path string", value)
    p = Path(value).expanduser()
    if base is not None and not p.is_absolute():
        p = base / p
    return p


def str_list(value: object, source: str, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise expected(source, key, "a list of strings", value)
    return tuple(str(v) for v in value)


# The values most keys take. Each converter raises ValueError (or a
# ConfigError of its own) for a value that is not what its words say.


def _number(raw: object) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise TypeError(raw)
    return float(raw)


def _whole(raw: object) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise TypeError(raw)
    return raw


def _checked(test: Callable[[Any], bool], convert: Callable[[Any], _T]) -> Callable[[Any, At], _T]:
    def check(raw: Any, at: At) -> _T:
        value = convert(raw)
        if not test(value):
            raise ValueError(raw)
        return value

    return check


def _bool(raw: Any, at: At) -> bool:
    if not isinstance(raw, bool):
        raise TypeError(raw)
    return raw


SECONDS = Value("a positive number of seconds", _checked(lambda v: math.isfinite(v) and v > 0, _number))
BOOL = Value("true or false", _bool)
PATH = Value("a non-empty path string", lambda raw, at: path(raw, at.where, at.key, at.base))
STRINGS = Value("a list of strings", lambda raw, at: str_list(raw, at.where, at.key))


def _string(raw: Any, at: At) -> str:
    if not isinstance(raw, str):
        raise TypeError(raw)
    return raw


def string(what: str) -> Value:
    """
    A string, C{what} in words (anything else is refused naming the key).
    """
    return Value(what, _string)


def positive(what: str) -> Value:
    """
    A positive finite number, C{what} in words.
    """
    return Value(what, SECONDS.convert)


def count(what: str, least: int = 0) -> Value:
    """
    A whole number from C{least} up (counts, bytes, layers), C{what} in
    words: C{max_loaded_models}, C{memory_budget_bytes},
    C{gpu_reserve_bytes}, C{max_connections_per_ip}, C{max_blob_bytes}.
    """
    return Value(what, _checked(lambda v: v >= least, _whole))


POSITIVE_INT = count("a positive integer", least=1)


def seconds_or_zero(what: str) -> Value:
    """
    0 or a number of seconds (not NaN), C{what} in words: 0 turns
    something off (C{session_keep_secs}, C{responses_ttl_secs}, ...).
    """
    return Value(what, _checked(lambda v: v >= 0, _number))


def choice(what: str, choices: tuple[str, ...], aliases: Mapping[str, str] | None = None) -> Value:
    """
    One of the strings C{choices} (or of C{aliases}, other names of a
    choice), C{what} in words.
    """
    renamed = dict(aliases or {})

    def convert(raw: Any, at: At) -> str:
        if not isinstance(raw, str) or raw not in (*choices, *renamed):
            raise ValueError(raw)
        return renamed.get(raw, raw)

    return Value(what, convert)


def url(what: str, strip: bool = True) -> Value:
    """
    An http:// or https:// URL, C{what} in words; without a trailing C{/}
    when C{strip}.
    """

    def convert(raw: Any, at: At) -> str:
        if not isinstance(raw, str) or not raw.startswith(("http://", "https://")):
            raise ValueError(raw)
        return raw.rstrip("/") if strip else raw

    return Value(what, convert)


def hosts(brackets: bool) -> Value:
    """
    Host names as the operator writes them, compared as the requests' are:
    lower case, no trailing dot; without IPv6 brackets unless C{brackets}.
    """

    def convert(raw: Any, at: At) -> tuple[str, ...]:
        names = (h.lower().rstrip(".") for h in str_list(raw, at.where, at.key))
        return tuple(names if brackets else (h.removeprefix("[").removesuffix("]") for h in names))

    return Value("a list of strings", convert)
