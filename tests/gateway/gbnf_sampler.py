"""
A random generator for GBNF, llama.cpp's grammar format, as far as
L{blazar.gateway.grammar} writes it: given a grammar, strings it admits.

The subset read is llama.cpp's C{grammar-parser.cpp} without its token
and C{.} extensions: rules C{name ::= body} (a body goes on over newlines
only inside parentheses), string literals C{"..."}, character classes
C{[...]} and C{[^...]} with ranges, rule references, groups, alternation
C{|}, the quantifiers C{?}, C{*}, C{+}, C{{m}}, C{{m,n}} and C{{m,}}, and
C{#} comments. Escapes are llama.cpp's own (C{\\xHH}, C{\\uHHHH},
C{\\UHHHHHHHH}, C{\\t}, C{\\r}, C{\\n}, C{\\\\}, C{\\"}, C{\\[}, C{\\]}): any
other one is refused, as llama-server refuses the whole grammar.

A generator, not a recognizer: what it yields is what a model decoding
under the grammar could write, so a property test can check every one of
them (tests/gateway/test_grammar_property.py).
"""

from __future__ import annotations

import functools
import random
from typing import Union

import attrs

# unbounded repetition (*, +, {m,}) adds at most this many beyond its minimum
UNBOUNDED_EXTRA = 3

# what a negated class picks from: printable ASCII, a few control
# characters (a class that forgot to refuse them shows it), DEL, and
# non-ASCII of every UTF-8 length (é: 2 bytes, 中 and U+2028: 3, emoji: 4)
NEGATED_POOL = tuple(chr(c) for c in range(0x20, 0x7F)) + (
    "\x00",
    "\t",
    "\n",
    "\x1f",
    "\x7f",
    "é",
    "ß",
    "中",
    "\u2028",
    "😀",
    "\U0001f9ea",
)

MAX_NESTING = 200


class GrammarSyntaxError(ValueError):
    """
    Text that is not GBNF of the subset read here; the message says where.
    """


@attrs.frozen
class Literal:
    text: str


@attrs.frozen
class CharClass:
    negated: bool
    ranges: tuple[tuple[int, int], ...]  # inclusive code point ranges

    def admits(self, char: str) -> bool:
        inside = any(low <= ord(char) <= high for low, high in self.ranges)
        return inside != self.negated


@attrs.frozen
class Reference:
    name: str


@attrs.frozen
class Sequence:
    items: tuple[Node, ...]


@attrs.frozen
class Alternation:
    options: tuple[Node, ...]


@attrs.frozen
class Repeat:
    item: Node
    low: int
    high: int | None  # None: unbounded


Node = Union[Literal, CharClass, Reference, Sequence, Alternation, Repeat]

_SIMPLE_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


class _Parser:
    """
    Recursive descent over one grammar's text, after llama.cpp's
    C{parse_sequence} / C{parse_alternates}.
    """

    def __init__(self, text: str) -> None:
        self._text = text
        self._pos = 0

    def _fail(self, what: str) -> GrammarSyntaxError:
        line = self._text.count("\n", 0, self._pos) + 1
        return GrammarSyntaxError(f"line {line}: {what} at {self._text[self._pos : self._pos + 30]!r}")

    def _peek(self) -> str:
        return self._text[self._pos] if self._pos < len(self._text) else ""

    def _space(self, newlines: bool) -> None:
        while self._pos < len(self._text):
            c = self._text[self._pos]
            if c == "#":
                while self._pos < len(self._text) and self._text[self._pos] not in "\r\n":
                    self._pos += 1
            elif c in " \t" or (newlines and c in "\r\n"):
                self._pos += 1
            else:
                return

    def _name(self) -> str:
        start = self._pos
        while self._pos < len(self._text) and (
            self._text[self._pos].isalnum() and self._text[self._pos].isascii() or self._text[self._pos] in "-_"
        ):
            self._pos += 1
        if start == self._pos:
            raise self._fail("expected a rule name")
        return self._text[start : self._pos]

    def _int(self) -> int:
        start = self._pos
        while self._peek().isdigit():
            self._pos += 1
        if start == self._pos:
            raise self._fail("expected a number")
        return int(self._text[start : self._pos])

    def _char(self) -> str:
        """
        One character of a literal or a class, escapes decoded.
        """
        c = self._peek()
        if not c:
            raise self._fail("unexpected end")
        if c != "\\":
            self._pos += 1
            return c
        kind = self._text[self._pos + 1 : self._pos + 2]
        if kind in _SIMPLE_ESCAPES:
            self._pos += 2
            return _SIMPLE_ESCAPES[kind]
        if kind in _HEX_ESCAPES:
            digits = self._text[self._pos + 2 : self._pos + 2 + _HEX_ESCAPES[kind]]
            if len(digits) != _HEX_ESCAPES[kind] or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self._fail(f"a \\{kind} escape needs {_HEX_ESCAPES[kind]} hex digits")
            self._pos += 2 + len(digits)
            return chr(int(digits, 16))
        raise self._fail("unknown escape (llama.cpp refuses it)")

    def rules(self) -> dict[str, Node]:
        rules: dict[str, Node] = {}
        self._space(True)
        while self._pos < len(self._text):
            name = self._name()
            self._space(False)
            if not self._text.startswith("::=", self._pos):
                raise self._fail("expected ::=")
            self._pos += 3
            self._space(True)
            if name in rules:
                raise self._fail(f"rule {name} defined twice")
            rules[name] = self._alternation(nested=False)
            if self._peek() not in ("", "\r", "\n"):
                raise self._fail("expected the end of the rule")
            self._space(True)
        return rules

    def _alternation(self, nested: bool) -> Node:
        options = [self._sequence(nested)]
        while self._peek() == "|":
            self._pos += 1
            self._space(True)
            options.append(self._sequence(nested))
        return options[0] if len(options) == 1 else Alternation(tuple(options))

    def _sequence(self, nested: bool) -> Node:
        items: list[Node] = []
        while True:
            c = self._peek()
            if c == '"':
                self._pos += 1
                chars = []
                while self._peek() != '"':
                    chars.append(self._char())
                self._pos += 1
                item: Node = Literal("".join(chars))
            elif c == "[":
                self._pos += 1
                negated = self._peek() == "^"
                if negated:
                    self._pos += 1
                ranges = []
                while self._peek() != "]":
                    low = self._char()
                    high = low
                    if self._peek() == "-" and self._text[self._pos + 1 : self._pos + 2] != "]":
                        self._pos += 1
                        high = self._char()
                    if ord(high) < ord(low):
                        raise self._fail("a range that ends below its start")
                    ranges.append((ord(low), ord(high)))
                self._pos += 1
                item = CharClass(negated, tuple(ranges))
            elif c == "(":
                self._pos += 1
                self._space(True)
                item = self._alternation(nested=True)
                if self._peek() != ")":
                    raise self._fail("expected )")
                self._pos += 1
            elif c and (c.isascii() and c.isalnum() or c in "-_"):
                item = Reference(self._name())
            else:
                break
            self._space(nested)
            item = self._quantified(item, nested)
            items.append(item)
        return items[0] if len(items) == 1 else Sequence(tuple(items))  # () : the empty string

    def _quantified(self, item: Node, nested: bool) -> Node:
        while True:
            c = self._peek()
            if c == "?":
                item = Repeat(item, 0, 1)
            elif c == "*":
                item = Repeat(item, 0, None)
            elif c == "+":
                item = Repeat(item, 1, None)
            elif c == "{":
                self._pos += 1
                self._space(False)
                low = self._int()
                self._space(False)
                high: int | None = low
                if self._peek() == ",":
                    self._pos += 1
                    self._space(False)
                    high = self._int() if self._peek().isdigit() else None
                    self._space(False)
                if self._peek() != "}":
                    raise self._fail("expected }")
                if high is not None and high < low:
                    raise self._fail("a repetition whose maximum is below its minimum")
                item = Repeat(item, low, high)
            else:
                return item
            self._pos += 1
            self._space(nested)


@attrs.frozen
class GBNF:
    """
    A parsed grammar: its rules by name.
    """

    rules: dict[str, Node]

    def sample(self, rng: random.Random, start: str = "root") -> str:
        """
        One string the grammar admits from rule C{start}: each alternative
        and each repetition count drawn from C{rng} (unbounded ones at most
        L{UNBOUNDED_EXTRA} beyond their minimum), a class's character drawn
        from its ranges or, negated, from L{NEGATED_POOL}.

        @raise GrammarSyntaxError: An undefined rule, a class that admits
            nothing from the pool, or nesting past L{MAX_NESTING}.
        """
        out: list[str] = []
        self._emit(Reference(start), rng, out, 0)
        return "".join(out)

    def _emit(self, node: Node, rng: random.Random, out: list[str], depth: int) -> None:
        if depth > MAX_NESTING:
            raise GrammarSyntaxError(f"nested deeper than {MAX_NESTING} (a recursive rule?)")
        if isinstance(node, Literal):
            out.append(node.text)
        elif isinstance(node, CharClass):
            out.append(_pick(node, rng))
        elif isinstance(node, Reference):
            if node.name not in self.rules:
                raise GrammarSyntaxError(f"rule {node.name} is not defined")
            self._emit(self.rules[node.name], rng, out, depth + 1)
        elif isinstance(node, Sequence):
            for item in node.items:
                self._emit(item, rng, out, depth + 1)
        elif isinstance(node, Alternation):
            self._emit(rng.choice(node.options), rng, out, depth + 1)
        else:
            high = node.low + UNBOUNDED_EXTRA if node.high is None else node.high
            for _ in range(rng.randint(node.low, high)):
                self._emit(node.item, rng, out, depth + 1)


def _pick(node: CharClass, rng: random.Random) -> str:
    if node.negated:
        pool = _pool(node)
        if not pool:
            raise GrammarSyntaxError(f"nothing in the pool is admitted by {node}")
        return rng.choice(pool)
    low, high = rng.choice(node.ranges)
    return chr(rng.randint(low, high))


@functools.lru_cache(maxsize=64)
def _pool(node: CharClass) -> tuple[str, ...]:
    return tuple(c for c in NEGATED_POOL if node.admits(c))


def parse(text: str) -> GBNF:
    """
    C{text} as a grammar.

    @raise GrammarSyntaxError: Not GBNF (of this subset), or a rule
        referenced and not defined.
    """
    rules = _Parser(text).rules()
    for node in rules.values():
        for name in _references(node):
            if name not in rules:
                raise GrammarSyntaxError(f"rule {name} is not defined")
    return GBNF(rules)


def _references(node: Node) -> list[str]:
    if isinstance(node, Reference):
        return [node.name]
    if isinstance(node, Sequence):
        return [n for item in node.items for n in _references(item)]
    if isinstance(node, Alternation):
        return [n for option in node.options for n in _references(option)]
    if isinstance(node, Repeat):
        return _references(node.item)
    return []


def sample(text: str, rng: random.Random, start: str = "root") -> str:
    """
    One string C{text}'s grammar admits (L{GBNF.sample}).
    """
    return parse(text).sample(rng, start)
