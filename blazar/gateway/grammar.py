"""
JSON schemas as GBNF grammars for llama-server's C{grammar} field: compact
JSON (no whitespace between tokens), every string, array and number
bounded, so the length of anything the grammar admits is bounded too. A
forced tool call decoded under it ends as valid JSON within its token
budget, whatever the model (L{blazar.gateway.toolcalls}).

Supported: C{type} (one or a list), C{properties} / C{required} (in
declared order, optional ones optional; nothing undeclared, unless
C{additionalProperties} is given: then an object without C{properties}
takes up to 4 free members), C{enum},
C{const}, C{items} / C{minItems} / C{maxItems}, C{minLength} /
C{maxLength}, integer C{minimum} / C{maximum} (a range of at most 256
values is enumerated; a lower bound of 0 or more drops the sign), C{oneOf}
/ C{anyOf} (each branch with the keywords beside it; C{oneOf} read as
C{anyOf}: a value two branches admit is admitted), local C{$ref}
(C{#/$defs/...}, C{#/definitions/...}), and
C{format} (read as a plain string). Anything else that constrains values
(C{pattern}, C{allOf}, C{not}, C{if}, remote C{$ref}, ...) raises
L{Unsupported} naming it: a grammar that ignored it would admit values the
schema refuses.
"""

from __future__ import annotations

import time
from typing import Any

from blazar import strictjson

NODE_BUDGET = 4096  # subschemas one grammar may walk (Claude Code's whole toolset: about 600)
DEADLINE = 2.0  # seconds a forced call's grammar may take to make (L{blazar.gateway.toolcalls.thd_prepare})
FREE_MEMBERS = 4
FREE_ITEMS = 8
MAX_DEPTH = 24
RANGE_LIMIT = 256
UNSUPPORTED = (
    "pattern",
    "patternProperties",
    "allOf",
    "not",
    "if",
    "then",
    "else",
    "dependentSchemas",
    "dependentRequired",
    "propertyNames",
    "contains",
    "prefixItems",
    "unevaluatedProperties",
    "multipleOf",
    "uniqueItems",
    "minProperties",
    "maxProperties",
)

PRIMITIVES = {
    # one character each: a \u escape is never a lone surrogate (no UTF-8
    # can carry it), and a pair of them is one character, as minLength counts
    "char": r'[^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" ([0-9a-cA-CefEF] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2} | '
    r'[dD] [89abAB] [0-9a-fA-F]{2} "\\u" [dD] [c-fC-F] [0-9a-fA-F]{2}))',
    "integer": '"-"? ("0" | [1-9] [0-9]{0,15})',
    "natural": '"0" | [1-9] [0-9]{0,15}',
    "number": 'integer ("." [0-9]{1,15})? ([eE] [-+]? [0-9]{1,2})?',
    "boolean": '"true" | "false"',
    "null": '"null"',
}


class Unsupported(ValueError):
    """
    A schema construct the grammar cannot express; the message names it
    and where (a JSON pointer).
    """


def literal(value: Any) -> str:
    """
    A GBNF literal matching C{value}'s compact JSON encoding.
    """
    text = strictjson.encode(value, ensure_ascii=False, separators=(",", ":"))
    return strictjson.encode(text, ensure_ascii=False)


class Grammar:
    """
    Rules made while walking one schema.

    The walk is bounded, so no schema can make it long (issue 36: a type
    list of 30 entries nested 4 deep cost 30^4 walks and froze the daemon):
    each distinct subschema is walked once at each depth (a memo), a type
    list counts each type once, and a walk that visits more than C{nodes}
    subschemas (each counts, remembered or not), or runs past C{deadline},
    is refused (L{Unsupported}).
    """

    def __init__(
        self, root_schema: Any, string_cap: int, nodes: int = NODE_BUDGET, deadline: float | None = None
    ) -> None:
        """
        @param nodes: The most subschemas the walk may visit.
        @param deadline: C{time.monotonic()} past which the walk stops.
        """
        self._root = root_schema
        self._cap = string_cap
        self.rules: dict[str, str] = {}
        self._refs: dict[str, str] = {}
        self._resolving: set[str] = set()
        self._used: set[str] = set()
        self._memo: dict[tuple[str, int], str] = {}
        self._named: dict[tuple[str, str], str] = {}  # (base, body) -> the rule's name
        self._counts: dict[str, int] = {}  # base -> the next number for its rules
        self._nodes = nodes
        self._deadline = deadline

    def use_root(self, schema: Any) -> None:
        """
        Resolve C{$ref}s against C{schema} from now on (one tool's
        parameters at a time).
        """
        self._root = schema
        self._refs = {}
        self._memo = {}

    def rule(self, base: str, body: str) -> str:
        """
        A named rule for C{body} (the same name for the same body).
        """
        return self._rule(base, body)

    def _rule(self, base: str, body: str) -> str:
        named = self._named.get((base, body))
        if named is not None:
            return named
        n = self._counts.get(base, 0)
        name = base if n == 0 else f"{base}{n}"
        while name in self.rules:  # (taken by a rule of another base)
            n += 1
            name = f"{base}{n}"
        self._counts[base] = n + 1
        self.rules[name] = body
        self._named[(base, body)] = name
        return name

    def _primitive(self, name: str) -> str:
        self._used.add(name)
        if name == "number":
            self._used.add("integer")
        return name

    def value(self, schema: Any, where: str, depth: int = 0) -> str:
        """
        A GBNF expression for the values C{schema} admits.

        @raise Unsupported: A construct it cannot express, or a schema too
            large to walk within the node budget or the deadline.
        """
        self._nodes -= 1  # every subschema counts, walked or remembered
        if self._nodes < 0:
            raise Unsupported(
                f"{where}: the schema is too large for a forced call's grammar (more than {NODE_BUDGET} subschemas)"
            )
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise Unsupported(f"{where}: the schema took too long to make a grammar of (over {DEADLINE:g} s)")
        try:
            key = (strictjson.encode(schema, sort_keys=True, separators=(",", ":")), depth)
        except (TypeError, ValueError):
            key = None
        if key is not None and key in self._memo:
            return self._memo[key]
        expression = self._value(schema, where, depth)
        if key is not None:
            self._memo[key] = expression
        return expression

    def _value(self, schema: Any, where: str, depth: int) -> str:
        if depth > MAX_DEPTH:
            raise Unsupported(f"{where}: nested deeper than {MAX_DEPTH} (a recursive $ref?)")
        if schema is True or schema == {}:
            return self._free(depth)
        if not isinstance(schema, dict):
            raise Unsupported(f"{where}: a schema must be an object")
        for key in UNSUPPORTED:
            if key in schema:
                raise Unsupported(f"{where}: {key}")
        if "$ref" in schema:
            return self._ref(schema["$ref"], where, depth)
        if "const" in schema:
            return literal(schema["const"])
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise Unsupported(f"{where}: enum must be a non-empty array")
            return "(" + " | ".join(literal(v) for v in schema["enum"]) + ")"
        for key in ("oneOf", "anyOf"):
            if key in schema:
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise Unsupported(f"{where}: {key} must be a non-empty array")
                base = {k: v for k, v in schema.items() if k != key}
                at = [f"{where}/{key}/{i}" for i in range(len(options))]
                return (
                    "(" + " | ".join(self.value(_branch(base, o, w), w, depth + 1) for o, w in zip(options, at)) + ")"
                )
        kind = schema.get("type")
        if isinstance(kind, list):
            # each type once
            kinds = list(dict.fromkeys(k if isinstance(k, str) else strictjson.encode(k) for k in kind))
            return "(" + " | ".join(self.value({**schema, "type": k}, where, depth + 1) for k in kinds) + ")"
        if kind is None:
            if "properties" in schema:
                kind = "object"
            elif "items" in schema:
                kind = "array"
            else:
                return self._free(depth)
        if kind == "string":
            return self._string(schema, where)
        if kind == "integer":
            return self._integer(schema, where)
        if kind == "number":
            return self._number(schema, where)
        if kind == "boolean":
            return self._primitive("boolean")
        if kind == "null":
            return self._primitive("null")
        if kind == "array":
            return self._array(schema, where, depth)
        if kind == "object":
            return self._object(schema, where, depth)
        raise Unsupported(f"{where}: type {kind!r}")

    def _string(self, schema: dict[str, Any], where: str) -> str:
        low = int(schema.get("minLength", 0) or 0)
        high = schema.get("maxLength")
        # a schema's own bound is kept when it fits the budget, else cut to
        # what fits (still within the schema)
        high = max(low, self._cap) if high is None else min(int(high), max(low, self._cap))
        if high < low:
            raise Unsupported(f"{where}: maxLength below minLength")
        self._used.add("char")
        return f'"\\"" char{{{low},{high}}} "\\""'

    def _integer(self, schema: dict[str, Any], where: str) -> str:
        low, high = _bounds(schema, where, integral=True)
        return int_range(low, high, where)

    def _number(self, schema: dict[str, Any], where: str) -> str:
        """
        A number within the schema's bounds: unbounded, any JSON number;
        bounded, an integer part within them and a fraction that cannot
        pass the upper one (a subset of the valid values, never more).
        """
        low, high = _bounds(schema, where, integral=False)
        if low is None and high is None:
            return self._primitive("number")
        import math

        lo = None if low is None else math.ceil(low)
        top = None if high is None else math.floor(high)
        fraction = '("." [0-9]{1,6})?'
        # a fraction moves a value away from zero: up from a whole part of
        # 0 or more, down from a negative one
        first = None if lo is None else lo + 1 if lo < 0 else lo
        last = None if top is None else top - 1 if top >= 0 else top
        if first is not None and last is not None and last < first:
            return int_range(lo, top, where)  # no room for a fraction
        whole = int_range(first, last, where)
        return f"({whole} {fraction})"

    def _array(self, schema: dict[str, Any], where: str, depth: int) -> str:
        items = schema.get("items", {})
        item = self.value(items, f"{where}/items", depth + 1)
        low = int(schema.get("minItems", 0) or 0)
        high = min(int(schema.get("maxItems", FREE_ITEMS)), max(low, FREE_ITEMS))
        if high < low:
            raise Unsupported(f"{where}: maxItems below minItems")
        if high == 0:
            return '"[]"'
        name = self._rule("item", item)
        more = f'("," {name}){{{max(0, low - 1)},{high - 1}}}'
        body = f'"[" {name} {more} "]"'
        return body if low > 0 else f'("[]" | {body})'

    def _object(self, schema: dict[str, Any], where: str, depth: int) -> str:
        properties = schema.get("properties")
        given = schema.get("required")
        required_list: list[Any] = given if isinstance(given, list) else []
        declared = properties if isinstance(properties, dict) else {}
        missing = [k for k in required_list if isinstance(k, str) and k not in declared]
        if missing and (declared or not properties):
            # required names that are not properties: additional members, of
            # additionalProperties' shape (any, if it gives none)
            extra = schema.get("additionalProperties")
            if extra is False:
                raise Unsupported(
                    f"{where}: required {missing[0]!r} is not a property, and additionalProperties is false"
                )
            properties = {**declared, **{k: extra if isinstance(extra, dict) else {} for k in missing}}
        if not properties:
            # only what is declared, unless more is asked for explicitly (as
            # llama.cpp's own converter reads it): a tool without
            # parameters is called with {}
            extra = schema.get("additionalProperties", False)
            if extra is False:
                return '"{}"'
            return self._free_object(extra if isinstance(extra, dict) else {}, where, depth)
        if not isinstance(properties, dict):
            raise Unsupported(f"{where}: properties must be an object")
        required = [k for k in required_list if isinstance(k, str) and k in properties]
        members = []
        for key, sub in properties.items():
            expr = f'{literal(key)} ":" {self.value(sub, f"{where}/properties/{key}", depth + 1)}'
            members.append((key in required, self._rule("member", expr)))
        # required members in order, each optional one in its place: a tail
        # rule per position, so commas come only between members
        tails: list[str] = [""]  # "": nothing (no rule)
        for must, rule in reversed(members):
            after = tails[-1]
            body = f'"," {rule} {after}' if must else f'("," {rule})? {after}'
            tails.append(self._rule("tail", body.strip()))
        tails.reverse()  # tails[i]: members i.. each after a comma
        first = ""  # members i.. with no comma before the first of them
        for i in range(len(members) - 1, -1, -1):
            must, rule = members[i]
            head = f"{rule} {tails[i + 1]}".strip()
            first = self._rule("first", head if must else (f"{head} | {first}" if first else f"({head})?"))
        return f'"{{" {first} "}}"'

    def _free_object(self, values: Any, where: str, depth: int) -> str:
        value = self.value(values, f"{where}/additionalProperties", depth + 1) if values else self._free(depth + 1)
        self._used.add("char")
        member = self._rule("freemember", f'"\\"" char{{1,{max(1, min(self._cap, 64))}}} "\\"" ":" {value}')
        return f'("{{}}" | "{{" {member} ("," {member}){{0,{FREE_MEMBERS - 1}}} "}}")'

    def _free(self, depth: int) -> str:
        """
        Any JSON value, nested at most two levels.
        """
        if depth > 2:
            return (
                f"({self._string({}, '')} | {self._primitive('number')} | {self._primitive('boolean')} | "
                f"{self._primitive('null')})"
            )
        inner = self._free(depth + 1)
        name = self._rule("free", inner)
        self._used.add("char")
        member = f'"\\"" char{{1,32}} "\\"" ":" {name}'
        return (
            f"({self._string({}, '')} | {self._primitive('number')} | {self._primitive('boolean')} | "
            f'{self._primitive("null")} | ("[]" | "[" {name} ("," {name}){{0,{FREE_ITEMS - 1}}} "]") | '
            f'("{{}}" | "{{" {member} ("," {member}){{0,{FREE_MEMBERS - 1}}} "}}"))'
        )

    def _ref(self, ref: Any, where: str, depth: int) -> str:
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise Unsupported(f"{where}: $ref {ref!r} (only local references, #/...)")
        if ref in self._refs:
            name = self._refs[ref]
            if name in self._resolving:
                # a value's length must be bounded: a schema that contains itself is not
                raise Unsupported(f"{where}: a recursive $ref ({ref})")
            return name
        target: Any = self._root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise Unsupported(f"{where}: $ref {ref!r} does not resolve")
            target = target[part]
        n = 0
        while f"ref{n}" in self.rules or f"ref{n}" in self._resolving:
            n += 1
        name = f"ref{n}"
        self._resolving.add(name)
        self._refs[ref] = name
        body = self.value(target, ref, depth + 1)
        self._resolving.discard(name)
        self.rules[name] = body
        return name

    def text(self, root: str) -> str:
        lines = [f"root ::= {root}"]
        lines += [f"{name} ::= {body}" for name, body in self.rules.items()]
        lines += [f"{name} ::= {PRIMITIVES[name]}" for name in sorted(self._used)]
        return "\n".join(lines) + "\n"


def _branch(base: dict[str, Any], option: Any, where: str) -> Any:
    """
    One branch of a C{oneOf} / C{anyOf} with the keywords beside it
    (C{base}), which hold for it too: the branch's keywords over the
    sibling ones, except those of an object, which both sides constrain:
    C{required} (both lists), C{properties} (a name of one side kept where
    the other side lets any value in as an additional property; a name in
    both takes the branch's schema, read as narrowing the sibling one) and
    C{additionalProperties} (the one that is not C{true}; C{false} if both
    are, and differ).

    @raise Unsupported: A required name that one side declares and the
        other refuses or constrains as an additional property.
    """
    if not isinstance(option, dict):
        return option
    merged = {**base, **option}
    extras = [
        s["additionalProperties"] for s in (base, option) if s.get("additionalProperties", True) not in (True, {})
    ]
    if extras:
        merged["additionalProperties"] = extras[0] if extras[-1] == extras[0] else False
    if isinstance(base.get("required"), list) and isinstance(option.get("required"), list):
        merged["required"] = list(dict.fromkeys(base["required"] + option["required"]))
    ours: dict[str, Any] = base["properties"] if isinstance(base.get("properties"), dict) else {}
    theirs: dict[str, Any] = option["properties"] if isinstance(option.get("properties"), dict) else {}
    every = {**ours, **theirs}
    if every:
        merged["properties"] = {
            k: v
            for k, v in every.items()
            if (k in ours or base.get("additionalProperties", True) in (True, {}))
            and (k in theirs or option.get("additionalProperties", True) in (True, {}))
        }
        for name in merged.get("required") or []:
            if name in every and name not in merged["properties"]:
                raise Unsupported(
                    f"{where}: required {name!r} is a property on one side and an additional "
                    "one, constrained, on the other"
                )
    return merged


def _bounds(schema: dict[str, Any], where: str, integral: bool) -> tuple[float | None, float | None]:
    """
    The inclusive bounds of a number (C{exclusive*} ones, numbers in
    draft 6 and later, turned inclusive for integers).
    """
    low, high = schema.get("minimum"), schema.get("maximum")
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        value = schema.get(key)
        if isinstance(value, bool):
            raise Unsupported(f"{where}: {key} as a boolean (draft 4): give it as a number")
        if value is None:
            continue
        if not isinstance(value, (int, float)) or not integral:
            raise Unsupported(f"{where}: {key} on a number")
        if key == "exclusiveMinimum":
            low = value + 1 if low is None else max(low, value + 1)
        else:
            high = value - 1 if high is None else min(high, value - 1)
    for value, key in ((low, "minimum"), (high, "maximum")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise Unsupported(f"{where}: {key} must be a number")
    if low is not None and high is not None and high < low:
        raise Unsupported(f"{where}: maximum below minimum")
    return low, high


def _digits(n: int) -> int:
    return len(str(n))


def int_range(low: float | None, high: float | None, where: str = "#") -> str:
    """
    GBNF for integers within C{[low, high]} (either open): a range of at
    most L{RANGE_LIMIT} values enumerated, else the numbers whose digit
    count puts them inside (a subset of the range, never more), at most 16
    digits.
    """
    import math

    lo = None if low is None else math.ceil(low)
    hi = None if high is None else math.floor(high)
    if lo is not None and hi is not None and hi < lo:
        raise Unsupported(f"{where}: no integer between minimum and maximum")
    if lo is not None and hi is not None and hi - lo < RANGE_LIMIT:
        return "(" + " | ".join(f'"{n}"' for n in range(lo, hi + 1)) + ")"
    parts = []
    # non-negative part
    if hi is None or hi >= 0:
        start = max(lo, 0) if lo is not None else 0
        small = [str(n) for n in range(start, min(start + 10, (hi if hi is not None else start + 9) + 1))]
        # numbers with more digits than start and fewer than hi
        first = _digits(start) + 1
        last = min(16, _digits(hi) - 1) if hi is not None else 16
        if first <= last:
            parts.append(f"[1-9] [0-9]{{{first - 1},{last - 1}}}")
        parts += [f'"{n}"' for n in small]
    # negative part
    if lo is None or lo < 0:
        end = min(hi, -1) if hi is not None else -1  # the closest to zero
        first = _digits(-end) + 1
        last = min(16, _digits(-lo) - 1) if lo is not None else 16
        if first <= last:
            parts.append(f'"-" [1-9] [0-9]{{{first - 1},{last - 1}}}')
        parts += [f'"{n}"' for n in range(end, max(end - 10, (lo if lo is not None else end - 9) - 1), -1)]
    return "(" + " | ".join(dict.fromkeys(parts)) + ")"


def min_chars(schema: Any, depth: int = 0) -> int:
    """
    About the fewest characters a value of C{schema} takes (required
    members, C{minLength}, C{minItems}): what a call needs at least.
    """
    if depth > 8 or not isinstance(schema, dict):
        return 2
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"] if isinstance(schema["enum"], list) else []
        return min((len(strictjson.encode(v)) for v in values), default=2)
    for key in ("oneOf", "anyOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return min(min_chars(o, depth + 1) for o in schema[key])
    kind = schema.get("type")
    if kind == "string":
        return 2 + int(schema.get("minLength", 0) or 0)
    if kind == "array":
        return 2 + int(schema.get("minItems", 0) or 0) * (1 + min_chars(schema.get("items", {}), depth + 1))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        given = schema.get("required")
        required: list[Any] = given if isinstance(given, list) else []
        return 2 + sum(len(k) + 4 + min_chars(props.get(k, {}), depth + 1) for k in required if isinstance(k, str))
    return 1


def to_gbnf(schema: Any, string_cap: int, where: str = "#") -> str:
    """
    The grammar of C{schema}'s values, as compact JSON.

    @param string_cap: The C{maxLength} of strings that have none.
    @raise Unsupported: A construct it cannot express (named).
    """
    grammar = Grammar(schema, string_cap)
    root = grammar.value(schema, where)
    return grammar.text(root)
