"""
RFC 8259 JSON, read strictly. Python's C{json} reads C{NaN}, C{Infinity}
and C{-Infinity}, which are not JSON, and turns a number too large for a
double (C{1e999}) into infinity; written back, either becomes C{Infinity},
which strict parsers (every TypeScript SDK's C{JSON.parse}) refuse. What a
model or an engine wrote is read with L{loads} wherever Blazar may write it
again, so a value that is not a finite JSON number is refused where it is
read, not echoed. (Blazar writes every JSON with C{allow_nan=False}.)
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import orjson


class NotStrictJSON(ValueError):
    """
    Text that Python's C{json} reads but that is not strict JSON: the
    message names the value.
    """


def _constant(name: str) -> Any:
    raise NotStrictJSON(f"{name} is not a JSON number")


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotStrictJSON(f"{text[:40]} is out of range of a double")
    return value


def _integer(text: str) -> int:
    # an integer beyond a double is no number a JSON parser can hold
    # either (llama-server's refuses it with its own message)
    value = int(text) if len(text.lstrip("-")) <= 309 else None
    if value is None or abs(value) > sys.float_info.max:
        raise NotStrictJSON(f"{text[:40]} is out of range of a double")
    return value


_DECODER = json.JSONDecoder(parse_constant=_constant, parse_float=_number, parse_int=_integer)


def loads(text: str | bytes) -> Any:
    """
    C{text} as JSON, strictly.

    @raise ValueError: Not JSON, or holding C{NaN}, C{Infinity} or a number
        that overflows a double (L{NotStrictJSON}).
    """
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode(json.detect_encoding(text), "surrogatepass")
    return _DECODER.decode(text)


def is_finite(value: Any) -> bool:
    """
    Whether C{value} (decoded JSON) holds only finite numbers, however deep.
    """
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(is_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(is_finite(v) for v in value)
    return True


def encode(value: Any, **options: Any) -> str:
    """
    C{value} as strict JSON: C{json.dumps} with C{allow_nan=False}, so a
    NaN or an infinity raises C{ValueError} instead of being written as
    C{NaN} / C{Infinity}, which are not JSON. Every JSON Blazar writes goes
    through here (a test fails any C{json.dumps} elsewhere in C{blazar/}).

    @param options: C{json.dumps}'s other options (C{separators},
        C{ensure_ascii}, C{sort_keys}, C{indent}, C{default}).
    """
    return json.dumps(value, allow_nan=False, **options)


# a run of 19 digits or more: a number orjson may read differently from
# C{json} (an integer beyond 64 bits becomes a float there), so such text
# is read by C{json}; found by mapping every digit to 0 and looking for 19
# of them (a regular expression's search cost more than orjson's parse)
_DIGITS_AS_ZERO = bytes(ord("0") if chr(i).isdigit() and i < 128 else i for i in range(256))
_LONG_DIGITS = b"0" * 19
_NAN_MAY_HIDE = b"null"


def parse(data: bytes) -> Any:
    """
    C{data} as JSON, read as C{json.loads} reads it (no stricter, no
    laxer: where strictness matters, use L{loads}), with C{orjson} where it
    gives the same value: the per-chunk read of a translated stream.

    @raise ValueError: Not JSON.
    """
    if _LONG_DIGITS not in data.translate(_DIGITS_AS_ZERO):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass  # what json reads and orjson does not (NaN, a lone surrogate): json decides
    return json.loads(data)


def compact(value: Any) -> bytes:
    """
    C{value} as strict compact UTF-8 JSON: the bytes of
    C{encode(value, ensure_ascii=False, separators=(",", ":"))} (a float
    may be written in another of its exact forms: C{1e-05} as
    C{0.00001}), made by C{orjson}.

    @raise ValueError: A NaN or an infinity (C{orjson} would write
        C{null}), or a lone surrogate in a string (C{UnicodeEncodeError},
        as C{encode(...).encode("utf-8")} raises).
    """
    try:
        out = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        # an integer beyond 64 bits, a lone surrogate, a type orjson does not
        # know: json's encoder writes it or raises its own error
        return encode(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if _NAN_MAY_HIDE in out and not is_finite(value):
        raise ValueError("Out of range float values are not JSON compliant")
    return out
