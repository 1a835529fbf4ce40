"""
Strict JSON, both ways (issue 35): Blazar writes JSON only through
L{blazar.strictjson.encode} (C{allow_nan=False}), so a NaN or an infinity
is refused where Blazar writes it rather than sent as C{NaN} or
C{Infinity}, which no strict parser reads: no other C{json.dumps},
C{json.dump} or C{json.JSONEncoder} is in blazar/; and
L{blazar.strictjson.loads} refuses them where Blazar reads them.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

import blazar
from blazar import strictjson

PACKAGE = Path(blazar.__file__).parent
WRITERS = frozenset({"dumps", "dump", "JSONEncoder"})


def lenient_writes(source: str, strict_too: bool = False) -> list[int]:
    """
    The lines of C{source} that call C{json.dumps}, C{json.dump} or
    C{json.JSONEncoder} without C{allow_nan=False} (with C{strict_too}:
    with it too), however C{json} or the name was imported. A call that
    passes C{**kwargs} is counted: whether it allows NaN cannot be read
    from the source.
    """
    tree = ast.parse(source)
    modules = {"json"}
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "json"}
        elif isinstance(node, ast.ImportFrom) and node.module == "json":
            names |= {a.asname or a.name for a in node.names if a.name in WRITERS}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        writer = (
            isinstance(f, ast.Attribute)
            and f.attr in WRITERS
            and isinstance(f.value, ast.Name)
            and f.value.id in modules
        ) or (isinstance(f, ast.Name) and f.id in names)
        strict = any(
            k.arg == "allow_nan" and isinstance(k.value, ast.Constant) and k.value.value is False for k in node.keywords
        )
        if writer and (strict_too or not strict):
            lines.append(node.lineno)
    return sorted(lines)


class LenientWritesTests(SynchronousTestCase):
    def test_detector(self) -> None:
        """
        The detector finds each way of writing JSON that may allow NaN, and
        passes the strict ones.
        """
        source = "\n".join(
            [
                "import json",
                "import json as j",
                "from json import dumps, dump as d, JSONEncoder",
                "json.dumps(v)",  # 4
                "json.dumps(v, allow_nan=False)",
                "json.dump(v, f, allow_nan=True)",  # 6
                "j.dumps(v)",  # 7
                "dumps(v)",  # 8
                "d(v, f)",  # 9
                "JSONEncoder()",  # 10
                "json.JSONEncoder(allow_nan=False)",
                "json.dumps(v, **options)",  # 12
                "json.loads(t)",
                "other.dumps(v)",
                "json.dumps(\n    v,\n    allow_nan=False,\n)",
            ]
        )
        self.assertEqual(lenient_writes(source), [4, 6, 7, 8, 9, 10, 12])

    def test_every_write_refuses_nan(self) -> None:
        """
        No module in blazar/ writes JSON that may hold C{NaN} or C{Infinity}.
        """
        offenders = [
            f"{path.relative_to(PACKAGE.parent)}:{line}"
            for path in sorted(PACKAGE.rglob("*.py"))
            for line in lenient_writes(path.read_text(encoding="utf-8"))
        ]
        self.assertEqual(offenders, [], "json writes without allow_nan=False")

    def test_every_write_is_strictjsons(self) -> None:
        """
        Only L{blazar.strictjson.encode} calls C{json.dumps}: one writer, not
        a keyword to remember at every call.
        """
        offenders = [
            f"{path.relative_to(PACKAGE.parent)}:{line}"
            for path in sorted(PACKAGE.rglob("*.py"))
            if path.name != "strictjson.py"
            for line in lenient_writes(path.read_text(encoding="utf-8"), strict_too=True)
        ]
        self.assertEqual(offenders, [], "write JSON with blazar.strictjson.encode")
        self.assertEqual(lenient_writes("import json\njson.dumps(v, allow_nan=False)\n", strict_too=True), [2])

    def test_the_writer_refuses_what_is_not_json(self) -> None:
        for value in (float("nan"), float("inf"), {"a": [1.0, float("-inf")]}):
            self.assertRaises(ValueError, strictjson.encode, value)
        self.assertEqual(
            strictjson.encode({"b": 1, "a": [1.5]}, sort_keys=True, separators=(",", ":")), '{"a":[1.5],"b":1}'
        )


class LoadsTests(SynchronousTestCase):
    """
    L{strictjson.loads} reads RFC 8259 JSON only.
    """

    REFUSED = [
        "NaN",
        "Infinity",
        "-Infinity",
        "1e999",
        "-1e999",
        "1E400",
        "123456789e999",
        "1" + "0" * 400,
        "-" + "9" * 309,
    ]

    def test_refused(self) -> None:
        """
        The non-numbers Python reads, and numbers that overflow a double,
        are refused with L{strictjson.NotStrictJSON}, a C{ValueError},
        alone or deep inside a document, as text or as bytes.
        """
        for word in self.REFUSED:
            for text in (word, f'{{"a": [1, {{"b": {word}}}]}}', f"[{word}]"):
                for value in (text, text.encode("utf-8")):
                    with self.subTest(value=value):
                        e = self.assertRaises(strictjson.NotStrictJSON, strictjson.loads, value)
                        self.assertIsInstance(e, ValueError)

    def test_message_names_the_value(self) -> None:
        """
        The error says which value is not JSON.
        """
        e = self.assertRaises(strictjson.NotStrictJSON, strictjson.loads, '{"x": -Infinity}')
        self.assertIn("-Infinity", str(e))
        e = self.assertRaises(strictjson.NotStrictJSON, strictjson.loads, "[1e999]")
        self.assertIn("1e999", str(e))

    def test_finite(self) -> None:
        """
        Finite numbers, up to the largest double, are read as Python reads
        them; so is everything else JSON holds.
        """
        self.assertEqual(strictjson.loads("1e308"), 1e308)
        self.assertEqual(strictjson.loads("-1.7976931348623157e308"), -1.7976931348623157e308)
        self.assertEqual(strictjson.loads("1.5"), 1.5)
        self.assertEqual(strictjson.loads("5e-324"), 5e-324)
        self.assertEqual(strictjson.loads("1e-999"), 0.0)  # underflow is finite
        self.assertEqual(strictjson.loads("12345678901234567890"), 12345678901234567890)
        self.assertEqual(
            strictjson.loads('{"a": [1, 2.5, {"b": null, "c": true}], "d": "NaN Infinity"}'),
            {"a": [1, 2.5, {"b": None, "c": True}], "d": "NaN Infinity"},
        )

    def test_bytes(self) -> None:
        """
        Bytes are read in whichever UTF encoding RFC 8259 allows, as
        C{json.loads} reads them.
        """
        for encoding in ("utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"):
            with self.subTest(encoding=encoding):
                self.assertEqual(strictjson.loads('{"é": 1.5}'.encode(encoding)), {"é": 1.5})
        self.assertEqual(strictjson.loads(bytearray(b"[1]")), [1])  # type: ignore[arg-type]  # bytearray too, as json.loads takes

    def test_not_json(self) -> None:
        """
        Text that is not JSON at all is a C{ValueError}, as with C{json}.
        """
        for text in ("", "{", "nan", "[1,]", b"\xff\xfe\x00"):
            with self.subTest(text=text):
                self.assertRaises(ValueError, strictjson.loads, text)


class IsFiniteTests(SynchronousTestCase):
    def test_is_finite(self) -> None:
        """
        L{strictjson.is_finite} looks into lists and objects for a float
        that is not finite.
        """
        self.assertTrue(strictjson.is_finite({"a": [1, 1.5, "inf", None, {"b": 1e308}]}))
        for bad in (float("nan"), float("inf"), -float("inf")):
            for value in (bad, [bad], {"a": [{"b": bad}]}):
                with self.subTest(value=value):
                    self.assertFalse(strictjson.is_finite(value))
        self.assertFalse(strictjson.is_finite(("a", (1.0, float("nan")))))  # tuples too (written as arrays)


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
JSON_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _outcome(read: Any, data: bytes) -> Any:
    try:
        return ("value", repr(read(data)))  # repr: 1 and 1.0, -0.0 and 0.0 differ
    except ValueError:
        return ("refused", None)


class ParseTests(SynchronousTestCase):
    """
    L{strictjson.parse} reads what C{json.loads} reads, as it reads it
    (orjson where it agrees): no stricter, no laxer.
    """

    @settings(max_examples=300, deadline=None)
    @given(JSON_VALUES, st.booleans())
    def test_as_json_reads(self, value: Any, ascii: bool) -> None:
        data = json.dumps(value, ensure_ascii=ascii, allow_nan=False).encode("utf-8")
        self.assertEqual(_outcome(strictjson.parse, data), _outcome(json.loads, data))

    @settings(max_examples=300, deadline=None)
    @given(st.binary(max_size=40) | st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")))
    def test_any_bytes(self, data: bytes) -> None:
        self.assertEqual(_outcome(strictjson.parse, data), _outcome(json.loads, data))

    def test_what_orjson_reads_otherwise(self) -> None:
        """
        Where orjson would refuse, or read another value, json decides.
        """
        for data in (
            b"NaN",
            b'{"a":[Infinity,-Infinity]}',
            b"1e999",
            b'"\\ud800"',
            b"123456789012345678901234567890",
            b"-99999999999999999999",
            "[1.5]".encode("utf-16"),
            b"\xef\xbb\xbf[1]",
            b"{",
            b"",
        ):
            with self.subTest(data=data):
                self.assertEqual(_outcome(strictjson.parse, data), _outcome(json.loads, data))
        self.assertEqual(strictjson.parse(b"123456789012345678901234567890"), 123456789012345678901234567890)


class CompactTests(SynchronousTestCase):
    """
    L{strictjson.compact} writes what C{encode(ensure_ascii=False,
    separators=(",", ":"))} writes, as bytes, with the same refusals.
    """

    @settings(max_examples=300, deadline=None)
    @given(JSON_VALUES)
    def test_as_encode_writes(self, value: Any) -> None:
        out = strictjson.compact(value)
        self.assertEqual(json.loads(out), value)
        if "float" not in repr(type(value)) and not _has_float(value):
            # (a float may be written in another exact form: 1e-05 as 0.00001)
            self.assertEqual(out, strictjson.encode(value, ensure_ascii=False, separators=(",", ":")).encode())

    def test_refuses_what_is_not_json(self) -> None:
        for value in (float("nan"), float("inf"), {"a": [1.0, float("-inf")]}, {"t": (1, float("nan"))}):
            with self.subTest(value=value):
                self.assertRaises(ValueError, strictjson.compact, value)
        self.assertRaises(UnicodeEncodeError, strictjson.compact, {"a": "\ud800"})
        self.assertRaises(TypeError, strictjson.compact, {(1, 2): 3})

    def test_what_orjson_does_not_write(self) -> None:
        """
        An integer beyond 64 bits and keys that are not strings are written
        as C{json} writes them.
        """
        self.assertEqual(
            strictjson.compact({"n": 2**80, 1: None, None: 2.5}), b'{"n":1208925819614629174706176,"1":null,"null":2.5}'
        )
        self.assertEqual(strictjson.compact({2: "x", False: 1.5}), b'{"2":"x","false":1.5}')
        self.assertEqual(strictjson.compact({"a": None, "b": [None]}), b'{"a":null,"b":[null]}')


def _has_float(value: Any) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, dict):
        return any(_has_float(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_float(v) for v in value)
    return False


class OneJSONLibraryTests(SynchronousTestCase):
    def test_orjson_only_in_strictjson(self) -> None:
        """
        orjson (which writes a NaN as C{null}) is used through
        L{strictjson.parse} and L{strictjson.compact} only.
        """
        offenders = [
            str(path.relative_to(PACKAGE.parent))
            for path in sorted(PACKAGE.rglob("*.py"))
            if path.name != "strictjson.py" and _imports_orjson(path.read_text(encoding="utf-8"))
        ]
        self.assertEqual(offenders, [])
        self.assertTrue(_imports_orjson("from orjson import dumps\n"))
        self.assertFalse(_imports_orjson("# orjson\nimport json\n"))


def _imports_orjson(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "orjson" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "orjson":
            return True
    return False
