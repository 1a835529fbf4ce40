"""
The forced-call grammar's walk is bounded (issue 36, H1): a 1.5 KB schema
with a 30-entry type list nested 4 deep cost 30^4 walks on the reactor
and froze the daemon for 44 s. Each distinct subschema is now walked once
per depth, a type counts once, and a node budget and a deadline refuse
what is still too large, naming it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from blazar.gateway import grammar
from blazar.gateway.grammar import Grammar, Unsupported, to_gbnf
from blazar.gateway.toolcalls import Forced, ToolSchemaError, thd_prepare

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "clients"


def nested(kinds: list[str], depth: int) -> dict[str, Any]:
    """
    The attack's shape: a type list at every level, an object property
    holding the next level.
    """
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": kinds, "properties": {"a": schema, "b": schema}, "items": schema}
    return schema


class BoundsTests(SynchronousTestCase):
    def test_the_attacks_schema_is_made_at_once(self) -> None:
        schema = nested(["object"] * 30, 4)
        self.assertLess(len(json.dumps(schema)), 20_000)
        began = time.monotonic()
        text = to_gbnf(schema, 8)
        self.assertLess(time.monotonic() - began, 1.0)
        self.assertLess(len(text), 20_000)

    def test_every_type_at_every_level_is_walked_once(self) -> None:
        schema = nested(["object", "array", "string", "integer", "number", "boolean", "null"], 8)
        began = time.monotonic()
        to_gbnf(schema, 8)
        self.assertLess(time.monotonic() - began, 2.0)

    def test_too_many_subschemas_are_refused_by_name(self) -> None:
        schema = {
            "type": "object",
            "properties": {f"p{i}": {"type": "integer", "minimum": i, "maximum": i + 300} for i in range(20_000)},
        }
        with self.assertRaises(Unsupported) as caught:
            to_gbnf(schema, 8)
        self.assertIn("too large for a forced call's grammar", str(caught.exception))

    def test_past_its_deadline_the_walk_stops(self) -> None:
        with self.assertRaises(Unsupported) as caught:
            Grammar({}, 8, deadline=time.monotonic() - 1).value({"type": "string"}, "#")
        self.assertIn("took too long", str(caught.exception))

    def test_claude_codes_toolset_fits_the_budget(self) -> None:
        tools = json.loads((FIXTURES / "claude-code-tool-result.json").read_text())["body"]["tools"]
        walked = 0
        for tool in tools:
            if "input_schema" not in tool:
                continue
            g = Grammar(tool["input_schema"], 8)
            try:
                g.value(tool["input_schema"], "#")
            except Unsupported as e:
                self.assertNotIn("too large", str(e))
            walked += grammar.NODE_BUDGET - g._nodes
        self.assertLess(walked, grammar.NODE_BUDGET // 2, walked)

    def test_a_forced_call_of_too_large_a_tool_is_refused_off_the_reactor(self) -> None:
        huge = {
            "type": "function",
            "function": {
                "name": "huge",
                "parameters": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}},
            },
        }
        with self.assertRaises(ToolSchemaError) as caught:
            thd_prepare({"messages": []}, Forced((huge,), parallel=False, named=True), 64)
        self.assertIn("huge", str(caught.exception))
        self.assertIn("too large", str(caught.exception))
        small = {"type": "function", "function": {"name": "small", "parameters": nested(["object"] * 30, 4)}}
        forced, dropped, budget, body = thd_prepare({"messages": [], "seed": 3}, Forced((small,), False, True), None)
        self.assertEqual((dropped, body["seed"], body["n_predict"]), ([], 3, budget))
