"""
Property tests over the forced-call grammar (L{blazar.gateway.grammar},
L{blazar.gateway.toolcalls.call_grammar}; issue 35): every string the
grammar admits, as drawn by tests/gateway/gbnf_sampler.py, is strict JSON
(L{blazar.strictjson.loads}: no C{NaN} or C{Infinity}, no number that
overflows a double), can be written back as UTF-8, and validates against
the schema it was made from (Draft 2020-12). The grammar may admit fewer
values than the schema, never more.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any, Callable

import jsonschema
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from blazar import strictjson
from blazar.gateway.grammar import PRIMITIVES, Unsupported, to_gbnf
from blazar.gateway.toolcalls import (
    MAX_CALLS,
    Forced,
    ToolSchemaError,
    call_grammar,
    needed_tokens,
    parse_calls,
)
from tests.gateway.gbnf_sampler import parse

SAMPLES = 30  # strings drawn from each grammar
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

Schema = dict[str, Any]
Draw = Callable[[st.SearchStrategy[Any]], Any]

# property names with what JSON and GBNF escape, and what neither does
NAMES = st.sampled_from(
    ["a", "b", "city", "x_y", "", 'q"uote', "back\\slash", "new\nline", "é", "中文", "sp ace", "a/b", "~0", "😀"]
)
TEXT = st.text(st.characters(codec="utf-8") | st.sampled_from('"\\\n\x00\x1f\u2028é😀'), max_size=6)
SCALARS: dict[str, st.SearchStrategy[Any]] = {
    "string": TEXT,
    "integer": st.integers(-(10**20), 10**20),
    "number": st.floats(allow_nan=False, allow_infinity=False),
    "boolean": st.booleans(),
    "null": st.none(),
}
JSON_VALUES = st.recursive(
    st.one_of(*SCALARS.values()),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)
BOUNDS = (
    st.integers(-12, 12)
    | st.floats(-12, 12)
    | st.integers(-300, 300)
    | st.integers(-(10**18), 10**18)
    | st.floats(-1e6, 1e6)
)
FORMATS = st.sampled_from(["date-time", "date", "email", "uri", "uuid", "ipv4"])
# JSON types no value has two of ("number" stands for "integer" too)
DISJOINT = ["string", "boolean", "null", "number", "array", "object"]


def _optional(draw: Draw, schema: Schema, key: str, values: st.SearchStrategy[Any]) -> None:
    if draw(st.booleans()):
        schema[key] = draw(values)


@st.composite
def typed(draw: Draw, kind: str, depth: int, refs: tuple[str, ...]) -> Schema:
    """
    A schema whose values are all of JSON type C{kind}, with that kind's
    constraints.
    """
    schema: Schema = {"type": kind}
    if kind == "string":
        low = draw(st.integers(0, 4))
        if draw(st.booleans()):
            schema["minLength"] = low
        _optional(draw, schema, "maxLength", st.integers(low, low + 6))
        _optional(draw, schema, "format", FORMATS)
    elif kind in ("integer", "number"):
        low, high = sorted([draw(BOUNDS), draw(BOUNDS)])
        exclusive = kind == "integer" and draw(st.booleans())  # numbers refuse exclusive* (Unsupported)
        _optional(draw, schema, "exclusiveMinimum" if exclusive else "minimum", st.just(low))
        _optional(draw, schema, "exclusiveMaximum" if exclusive else "maximum", st.just(high))
    elif kind == "array":
        if draw(st.booleans()):
            schema["items"] = draw(schemas(depth - 1, refs))
        low = draw(st.integers(0, 3))
        if draw(st.booleans()):
            schema["minItems"] = low
        _optional(draw, schema, "maxItems", st.integers(low, low + 4))
    elif kind == "object":
        properties = draw(st.dictionaries(NAMES, schemas(depth - 1, refs), max_size=4))
        if properties or draw(st.booleans()):
            schema["properties"] = properties
        required = draw(st.lists(st.sampled_from(sorted(properties)), unique=True)) if properties else []
        if draw(st.integers(0, 3)) == 0:
            required.append(draw(NAMES))  # required, and not among the properties
        if required:
            schema["required"] = list(dict.fromkeys(required))
        _optional(draw, schema, "additionalProperties", st.booleans() | schemas(depth - 1, refs))
        if properties and draw(st.integers(0, 3)) == 0:
            # the common "one of these must be given": each branch adds to the siblings
            names = sorted(properties)
            schema["anyOf"] = draw(
                st.lists(st.builds(lambda n: {"required": [n]}, st.sampled_from(names)), min_size=1, max_size=3)
            )
    return schema


@st.composite
def schemas(draw: Draw, depth: int, refs: tuple[str, ...] = ()) -> Schema | bool:
    """
    A schema of the constructs L{blazar.gateway.grammar} supports, nested
    at most C{depth} levels, C{$ref}s pointing at C{refs}.
    """
    leaves = ["string", "integer", "number", "boolean", "null", "enum", "const", "free", "types"]
    branches = ["array", "object", "anyOf", "oneOf", "union"] if depth > 0 else []
    shape = draw(st.sampled_from(leaves + branches + (["ref"] if refs else [])))
    if shape == "free":
        return draw(st.sampled_from([{}, True]))
    if shape == "ref":
        return {"$ref": draw(st.sampled_from(refs))}
    if shape == "enum":
        kind = draw(st.sampled_from(sorted(SCALARS)))
        values = draw(st.lists(SCALARS[kind], min_size=1, max_size=4))
        return {"enum": values, "type": kind} if draw(st.booleans()) else {"enum": values}
    if shape == "const":
        return {"const": draw(JSON_VALUES)}
    if shape == "types":
        # a list of types, each with its own constraints (integer and number share theirs)
        kinds = draw(
            st.lists(
                st.sampled_from(["string", "integer", "number", "boolean", "null"]), min_size=1, max_size=3, unique=True
            )
        )
        if "integer" in kinds and "number" in kinds:
            kinds.remove("number")
        schema: Schema = {}
        for kind in kinds:
            schema.update(draw(typed(kind, depth, refs)))
        schema["type"] = kinds
        return schema
    if shape == "anyOf":
        return {"anyOf": draw(st.lists(schemas(depth - 1, refs), min_size=1, max_size=3))}
    if shape == "oneOf":
        # branches of disjoint types, so no value matches two of them
        kinds = draw(st.lists(st.sampled_from(DISJOINT), min_size=1, max_size=3, unique=True))
        return {
            "oneOf": [
                draw(typed(draw(st.sampled_from(["integer", "number"])) if k == "number" else k, depth - 1, refs))
                for k in kinds
            ]
        }
    if shape == "union":
        # a discriminated union: each branch narrows the shared "kind" to
        # its own value, and adds members of its own
        kinds = draw(st.lists(TEXT, min_size=1, max_size=3, unique=True))
        schema = draw(typed("object", depth, refs))
        schema.pop("anyOf", None)
        schema["properties"] = {**schema.get("properties", {}), "kind": {"type": "string", "enum": kinds}}
        schema["required"] = list(dict.fromkeys(schema.get("required", []) + ["kind"]))
        branches = []
        for kind in kinds:
            branch = draw(typed("object", depth - 1, refs))
            branch.pop("anyOf", None)
            # its own members: one named like a sibling would take the
            # branch's schema for both (blazar.gateway.grammar._branch)
            own = {k: v for k, v in branch.get("properties", {}).items() if k not in schema["properties"]}
            branch["properties"] = {**own, "kind": {"const": kind}}
            branches.append(branch)
        return {**schema, "oneOf": branches}
    return draw(typed(shape, depth, refs))


@st.composite
def documents(draw: Draw, depth: int = 3, root: Callable[..., st.SearchStrategy[Any]] = schemas) -> Schema | bool:
    """
    A whole schema: maybe some C{$defs} (or C{definitions}) and C{$ref}s
    to them.
    """
    where = draw(st.sampled_from(["$defs", "definitions"]))
    defs = draw(st.dictionaries(st.sampled_from(["A", "b/c", "d~e", "F"]), schemas(1), max_size=2))
    refs = tuple(f"#/{where}/" + n.replace("~", "~0").replace("/", "~1") for n in defs)
    schema = draw(root(depth, refs))
    if defs:
        if schema is True:
            schema = {}
        schema[where] = defs
    return schema


def check_value(text: str, validator: jsonschema.protocols.Validator, grammar: str) -> Any:
    """
    C{text}, drawn from C{grammar}: strict JSON, writable back as UTF-8,
    and valid.

    @return: The value.
    """
    text.encode("utf-8")
    try:
        value = strictjson.loads(text)
    except ValueError as e:
        raise AssertionError(f"{text!r} is not strict JSON ({e}); grammar:\n{grammar}") from None
    json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")  # as Blazar writes it again
    errors = [e.message for e in validator.iter_errors(value)]
    assert not errors, f"{text!r} admitted but invalid: {errors}; grammar:\n{grammar}"
    return value


@PROPERTY
@given(documents(), st.integers(0, 12), st.randoms(use_true_random=True))
def test_every_value_a_schema_grammar_admits_is_strict_valid_json(
    schema: Schema | bool,
    cap: int,
    rng: random.Random,
) -> None:
    jsonschema.Draft202012Validator.check_schema(schema)
    try:
        grammar = to_gbnf(schema, cap)
    except Unsupported:
        reject()  # an empty range of integers, and the like: refused, not wrong
    validator = jsonschema.Draft202012Validator(schema)
    parsed = parse(grammar)
    for _ in range(SAMPLES):
        check_value(parsed.sample(rng), validator, grammar)


def objects(depth: int, refs: tuple[str, ...]) -> st.SearchStrategy[Schema]:
    """
    A tool's parameters: an object schema.
    """
    return typed("object", depth, refs)


@st.composite
def forced_calls(draw: Draw) -> tuple[Forced, int]:
    """
    A forced call of 1 to 3 tools (parallel or not, named or not) and a
    budget that fits at least one call.
    """
    named = draw(st.booleans())
    names = draw(
        st.lists(
            st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True), min_size=1, max_size=1 if named else 3, unique=True
        )
    )
    tools = []
    for name in names:
        function: Schema = {"name": name, "description": "a tool"}
        if draw(st.integers(0, 4)):
            function["parameters"] = draw(documents(depth=2, root=objects))
        tools.append({"type": "function", "function": function})
    forced = Forced(tuple(tools), draw(st.booleans()), named=named)
    return forced, needed_tokens(forced) + draw(st.integers(0, 1500))


@PROPERTY
@given(forced_calls(), st.randoms(use_true_random=True))
def test_every_forced_call_the_grammar_admits_parses_and_validates(
    call: tuple[Forced, int],
    rng: random.Random,
) -> None:
    forced, budget = call
    try:
        grammar = call_grammar(forced, budget)
    except ToolSchemaError:
        reject()
    validators = {
        t["function"]["name"]: jsonschema.Draft202012Validator(
            t["function"].get("parameters") or {"type": "object", "properties": {}}
        )
        for t in forced.tools
    }
    parsed = parse(grammar)
    for _ in range(SAMPLES):
        text = parsed.sample(rng)
        value = check_value(text, jsonschema.Draft202012Validator({}), grammar)
        assert isinstance(value, list) == forced.parallel
        calls = parse_calls(text, forced)
        assert 1 <= len(calls) <= (MAX_CALLS if forced.parallel else 1)
        for name, arguments in calls:
            errors = [e.message for e in validators[name].iter_errors(arguments)]
            assert not errors, f"{name}({arguments!r}) admitted but invalid: {errors}; grammar:\n{grammar}"


def test_the_number_primitive_cannot_overflow_a_double() -> None:
    # at most 16 integer digits, 15 fraction digits and a 2-digit exponent:
    # the largest it admits is about 1e115, far below 1.8e308
    assert PRIMITIVES["integer"] == '"-"? ("0" | [1-9] [0-9]{0,15})'
    assert PRIMITIVES["number"] == 'integer ("." [0-9]{1,15})? ([eE] [-+]? [0-9]{1,2})?'
    assert math.isfinite(strictjson.loads("-" + "9" * 16 + "." + "9" * 15 + "e+99"))
    grammar = to_gbnf({"type": "number"}, 8)
    parsed = parse(grammar)
    rng = random.Random(35)
    exponents = set()
    for _ in range(3000):
        text = parsed.sample(rng)
        value = strictjson.loads(text)
        assert isinstance(value, (int, float)) and math.isfinite(value), text
        if "e" in text.lower():
            exponents.add(len(text.lower().split("e")[1].lstrip("+-")))
    assert exponents == {1, 2}


# what the properties found in the grammar, each its smallest schema
@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number", "minimum": -1},  # admitted -1.5: a fraction goes down from a negative whole part
        {"type": "number", "minimum": -7.5, "maximum": 3},
        {"type": "number", "maximum": 0},  # and up from 0: 0.5 stays out
        {"type": "object", "properties": {"a": {"type": "null"}}, "required": ["b"]},  # admitted {}: "b" was dropped
        # admitted {"a":null}: the branch's required list replaced the sibling one
        {
            "type": "object",
            "properties": {"a": {"type": "null"}, "b": {"type": "null"}},
            "required": ["a"],
            "anyOf": [{"required": ["b"]}],
        },
        # admitted {"kind":"x"}: the branch's properties replaced the sibling ones, required "n" went with them
        {
            "type": "object",
            "properties": {"kind": {"enum": ["x", "y"]}, "n": {"type": "null"}},
            "required": ["kind", "n"],
            "oneOf": [{"properties": {"kind": {"const": "x"}}}, {"properties": {"kind": {"const": "y"}}}],
        },
    ],
)
def test_found_by_the_properties(schema: Schema) -> None:
    grammar = to_gbnf(schema, 8)
    validator = jsonschema.Draft202012Validator(schema)
    parsed = parse(grammar)
    rng = random.Random(35)
    for _ in range(500):
        check_value(parsed.sample(rng), validator, grammar)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "required": ["a"], "additionalProperties": False},
        {"type": "object", "properties": {"b": {}}, "required": ["a"], "additionalProperties": False},
        {
            "type": "object",
            "additionalProperties": {"type": "boolean"},
            "anyOf": [{"properties": {"a": {"type": "null"}}, "required": ["a"]}],
        },
    ],
)
def test_what_no_value_satisfies_is_refused(schema: Schema) -> None:
    with pytest.raises(Unsupported, match="required 'a'"):
        to_gbnf(schema, 8)


def test_a_string_character_is_one_code_point_and_never_a_lone_surrogate() -> None:
    # a \u escape used to take any 4 hex digits: "\ud800" alone (no UTF-8
    # carries it: writing the call back failed), and a pair made one
    # character of two (so {"minLength": 2} admitted "\ud83d\ude00")
    parsed = parse(to_gbnf({"type": "string", "minLength": 1, "maxLength": 1}, 8))
    rng = random.Random(35)
    pairs = 0
    for _ in range(3000):
        char = parsed.sample(rng, "char")
        decoded = strictjson.loads(f'"{char}"')
        assert len(decoded) == 1 and not 0xD800 <= ord(decoded) <= 0xDFFF, char
        pairs += char.count("\\u") == 2
    assert pairs > 100
