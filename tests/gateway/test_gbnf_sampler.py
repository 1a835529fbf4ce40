"""
The GBNF generator the grammar property tests draw from
(tests/gateway/gbnf_sampler.py): on small hand-written grammars, exactly
the strings each admits.
"""

from __future__ import annotations

import random

import pytest

from tests.gateway.gbnf_sampler import NEGATED_POOL, UNBOUNDED_EXTRA, GrammarSyntaxError, parse, sample


def outputs(text: str, n: int = 2000, start: str = "root") -> set[str]:
    grammar = parse(text)
    rng = random.Random(35)
    return {grammar.sample(rng, start) for _ in range(n)}


def test_alternation_groups_and_bounded_repetition() -> None:
    text = 'root ::= "a" ("b" | "c")? x{2}\nx ::= [x-y]\n'
    assert outputs(text) == {"a" + m + x + y for m in ("", "b", "c") for x in "xy" for y in "xy"}
    assert outputs('root ::= "-"{1,3} "." {0,1}') == {"-", "--", "---", "-.", "--.", "---."}
    assert outputs('root ::= ("a" | ) "b"') == {"b", "ab"}


def test_unbounded_repetition_is_capped_small() -> None:
    assert outputs('root ::= "a"* "b"+') == {
        "a" * i + "b" * j for i in range(UNBOUNDED_EXTRA + 1) for j in range(1, UNBOUNDED_EXTRA + 2)
    }
    assert outputs('root ::= "z"{2,}') == {"z" * i for i in range(2, UNBOUNDED_EXTRA + 3)}


def test_literal_and_class_escapes_as_llama_cpp_reads_them() -> None:
    assert outputs(r'root ::= "\"\\\n\t\x41\u00e9\U0001F600" [\x30-\x31\]]') == {'"\\\n\tAé😀' + c for c in "01]"}
    assert outputs(r'root ::= "\\" (["\\/bfnrt])') == {"\\" + c for c in '"\\/bfnrt'}
    with pytest.raises(GrammarSyntaxError, match="unknown escape"):
        parse(r'root ::= "\b"')  # JSON has \b; llama.cpp's grammar does not
    with pytest.raises(GrammarSyntaxError, match="hex"):
        parse(r'root ::= "\u12"')


def test_a_negated_class_picks_from_the_pool() -> None:
    got = outputs(r'root ::= [^"\\\x00-\x1f]', n=5000)
    assert got == {c for c in NEGATED_POOL if c not in '"\\' and ord(c) >= 0x20}
    assert {"é", "中", "😀", "\x7f"} <= got
    assert outputs(r"root ::= [^a-z]", n=5000) >= {"\x00", "\n", "A"}  # control characters too, unless refused


def test_rules_span_lines_only_inside_parentheses_and_comments_are_skipped() -> None:
    text = '# a comment\nroot ::= ("x" # inside\n  | "y") z\nz ::= "!"  # after\n'
    assert outputs(text) == {"x!", "y!"}
    with pytest.raises(GrammarSyntaxError, match="::="):
        parse('root ::= "x"\n  z\nz ::= "!"')  # outside parentheses a line ends the rule
    assert outputs('root ::= a\na ::= "1"\nb ::= "2"\n', start="b") == {"2"}
    assert sample('root ::= "only"', random.Random(0)) == "only"


def test_malformed_grammars_are_refused() -> None:
    for text, message in [
        ("root ::= missing", "not defined"),
        ('root ::= "a"\nroot ::= "b"', "twice"),
        ('root = "a"', "::="),
        ('root ::= ("a"', r"expected \)"),
        ('root ::= "a"{3,1}', "below"),
        ("root ::= [b-a]", "below"),
        ('root ::= "unterminated', "end"),
    ]:
        with pytest.raises(GrammarSyntaxError, match=message):
            parse(text)
    with pytest.raises(GrammarSyntaxError, match="recursive"):
        sample('root ::= "(" root ")"', random.Random(0))
    with pytest.raises(GrammarSyntaxError, match="pool"):
        sample(r"root ::= [^\x00-\U0010FFFF]", random.Random(0))
