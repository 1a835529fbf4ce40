"""
The semantic cache's decisions and index (L{blazar.gateway.cache}) and its
SQLite rows (L{blazar.store}), with no reactor.
"""

from __future__ import annotations

import json
import math
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from blazar import store
from blazar.gateway.cache import (
    Entry,
    SemanticIndex,
    Vector,
    bypass,
    embedding_of,
    from_blob,
    normalized,
    prompt_text,
    scope_of,
    to_blob,
)
from tests.postgres import PostgresStore, SQLiteStore


def chat(text: str, **extra: object) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}],
        **extra,
    }


def unit(*values: float) -> Vector:
    vector = normalized(values)
    assert vector is not None
    return vector


class BypassTests(SynchronousTestCase):
    def test_plain_chat_may_use_it(self) -> None:
        self.assertIsNone(bypass(chat("hi"), stream=False))

    def test_streams_tools_and_formats_bypass(self) -> None:
        self.assertEqual(bypass(chat("hi"), stream=True), "stream")
        self.assertEqual(bypass(chat("hi", stream=True), stream=False), "stream")
        self.assertEqual(bypass(chat("hi", tools=[{"type": "function", "function": {"name": "f"}}]), False), "tools")
        self.assertEqual(bypass(chat("hi", response_format={"type": "json_object"}), False), "response_format")
        self.assertEqual(bypass(chat("hi", n=2), False), "n")
        self.assertEqual(bypass({"messages": [{"role": "system", "content": "x"}]}, False), "no_user_turn")

    def test_empty_tools_do_not_bypass(self) -> None:
        self.assertIsNone(bypass(chat("hi", tools=[]), False))


class PromptTests(SynchronousTestCase):
    def test_the_last_user_turns_text_is_embedded(self) -> None:
        body = {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": "a"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "two"},
                        {"type": "image_url", "image_url": {"url": "data:x"}},
                        {"type": "text", "text": "three"},
                    ],
                },
                {"role": "assistant", "content": "prefill"},
            ]
        }
        self.assertEqual(prompt_text(body), "two\nthree")
        self.assertEqual(prompt_text(chat("hi")), "hi")

    def test_no_user_turn(self) -> None:
        self.assertIsNone(prompt_text({"messages": []}))
        self.assertIsNone(prompt_text({}))


def turns(*messages: tuple[str, Any], **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in messages], **fields}


class ScopeTests(SynchronousTestCase):
    def test_model_key_lane_and_sampling_separate_scopes(self) -> None:
        base = scope_of("m", "alice", "llamacpp", chat("hi", temperature=0))
        self.assertEqual(base, scope_of("m", "alice", "llamacpp", chat("other text", temperature=0)))
        self.assertNotEqual(base, scope_of("n", "alice", "llamacpp", chat("hi", temperature=0)))
        self.assertNotEqual(base, scope_of("m", "bob", "llamacpp", chat("hi", temperature=0)))
        self.assertNotEqual(base, scope_of("m", "alice", "vllm", chat("hi", temperature=0)))
        self.assertNotEqual(base, scope_of("m", "alice", "llamacpp", chat("hi", temperature=1)))
        self.assertNotEqual(base, scope_of("m", "alice", "llamacpp", chat("hi", temperature=0, max_tokens=5)))
        # what cannot change the answer does not separate them
        self.assertEqual(
            base,
            scope_of("m", "alice", "llamacpp", chat("hi", temperature=0, user="u", stream=False, metadata={"a": "b"})),
        )

    def test_every_other_field_separates_them(self) -> None:
        # llama-server's own samplers, tool settings, Ollama's options: none of them is listed anywhere
        base = scope_of("m", "", "llamacpp", chat("hi"))
        for field, value in (
            ("xtc_probability", 0.5),
            ("dry_multiplier", 0.8),
            ("samplers", ["top_k"]),
            ("ignore_eos", True),
            ("tool_choice", "none"),
            ("parallel_tool_calls", False),
            ("prediction", {"type": "content", "content": "x"}),
            ("verbosity", "low"),
            ("options", {"num_ctx": 8192}),
            ("thinking", {"type": "enabled"}),
        ):
            self.assertNotEqual(base, scope_of("m", "", "llamacpp", chat("hi", **{field: value})), field)

    def test_the_context_before_the_last_user_turn_must_be_identical(self) -> None:
        two = turns(("user", "a"), ("user", "b"))
        merged = turns(("user", "a\nuser: b"))
        self.assertNotEqual(scope_of("m", "", "llamacpp", two), scope_of("m", "", "llamacpp", merged))
        long_system = "lorem ipsum dolor " * 100
        self.assertEqual(
            scope_of("m", "", "llamacpp", turns(("system", long_system), ("user", "What is 2+2?"))),
            scope_of("m", "", "llamacpp", turns(("system", long_system), ("user", "Delete my files"))),
        )
        # ... so that only the questions are compared, not the system prompt that swamps them
        self.assertEqual(prompt_text(turns(("system", long_system), ("user", "Delete my files"))), "Delete my files")
        calls = [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "w", "arguments": '{"city":"Paris"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "1", "content": "sunny"},
            {"role": "user", "content": "and?"},
        ]
        oslo = json.loads(json.dumps(calls).replace("Paris", "Oslo"))
        self.assertNotEqual(
            scope_of("m", "", "llamacpp", {"messages": calls}), scope_of("m", "", "llamacpp", {"messages": oslo})
        )
        named = [{"role": "user", "name": "ann", "content": "hi"}]
        self.assertNotEqual(
            scope_of("m", "", "llamacpp", {"messages": named}),
            scope_of("m", "", "llamacpp", {"messages": [{**named[0], "name": "bo"}]}),
        )

    def test_the_last_turns_other_parts_are_matched_exactly(self) -> None:
        def with_audio(data: str) -> dict[str, Any]:
            return {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is said?"},
                            {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
                        ],
                    }
                ]
            }

        self.assertNotEqual(
            scope_of("m", "", "llamacpp", with_audio("AAAA")), scope_of("m", "", "llamacpp", with_audio("BBBB"))
        )
        self.assertEqual(prompt_text(with_audio("AAAA")), "what is said?")

    def test_a_prefill_after_the_last_user_turn_is_part_of_the_scope(self) -> None:
        body = chat("hi")
        prefilled = {"messages": [*body["messages"], {"role": "assistant", "content": "Sure"}]}
        self.assertNotEqual(scope_of("m", "", "llamacpp", body), scope_of("m", "", "llamacpp", prefilled))


class VectorTests(SynchronousTestCase):
    def test_normalized(self) -> None:
        vector = normalized([3.0, 4.0])
        assert vector is not None
        self.assertAlmostEqual(float(vector[0]), 0.6, places=6)
        self.assertIsNone(normalized([0.0, 0.0]))
        self.assertIsNone(normalized([]))
        self.assertIsNone(normalized([math.nan, 1.0]))

    def test_embedding_answers(self) -> None:
        vector = embedding_of({"data": [{"embedding": [0.0, 2.0]}]})
        assert vector is not None
        self.assertEqual(vector.tolist(), [0.0, 1.0])
        native = embedding_of([{"embedding": [[2.0, 0.0]]}])
        assert native is not None
        self.assertEqual(native.tolist(), [1.0, 0.0])
        self.assertIsNone(embedding_of({"error": "x"}))

    def test_blob_round_trip(self) -> None:
        vector = unit(1.0, 2.0, 3.0)
        self.assertEqual(from_blob(to_blob(vector)).tolist(), vector.tolist())


class IndexTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.index = SemanticIndex()
        self.index.add(Entry(1, "s", 100.0, unit(1.0, 0.0), b"one"), 10)
        self.index.add(Entry(2, "s", 100.0, unit(0.0, 1.0), b"two"), 10)

    def test_the_most_similar_above_the_threshold(self) -> None:
        similarity, entry = self.index.lookup("s", unit(1.0, 0.1), 101.0, 600.0, 0.9)
        assert entry is not None
        self.assertEqual(entry.answer, b"one")
        self.assertGreater(similarity, 0.99)

    def test_below_the_threshold_is_a_miss(self) -> None:
        similarity, entry = self.index.lookup("s", unit(1.0, 1.0), 101.0, 600.0, 0.9)
        self.assertIsNone(entry)
        self.assertAlmostEqual(similarity, math.sqrt(0.5), places=5)
        _, exact = self.index.lookup("s", unit(1.0, 1.0), 101.0, 600.0, 0.7)
        self.assertIsNotNone(exact)

    def test_another_scope_never_answers(self) -> None:
        self.assertEqual(self.index.lookup("other", unit(1.0, 0.0), 101.0, 600.0, 0.0), (-1.0, None))

    def test_expired_entries_do_not_answer_and_are_purged(self) -> None:
        _, entry = self.index.lookup("s", unit(1.0, 0.0), 701.0, 600.0, 0.9)
        self.assertIsNone(entry)
        _, entry = self.index.lookup("s", unit(1.0, 0.0), 700.0, 600.0, 0.9)
        assert entry is not None
        self.assertEqual(entry.answer, b"one")
        self.index.add(Entry(3, "s", 650.0, unit(1.0, 0.0), b"three"), 10)
        _, newer = self.index.lookup("s", unit(1.0, 0.0), 701.0, 600.0, 0.9)
        assert newer is not None
        self.assertEqual(newer.answer, b"three")
        self.assertEqual(self.index.purge(101.0), [1, 2])
        self.assertEqual(len(self.index), 1)

    def test_many_entries_the_nearest_by_its_exact_cosine(self) -> None:
        import numpy as np

        rng = np.random.default_rng(7)
        vectors = rng.normal(size=(3000, 64)).astype(np.float32)
        for i, v in enumerate(vectors):
            self.index.add(Entry(100 + i, "many", 100.0, v / np.linalg.norm(v), b"%d" % i), 10000)
        for i in (0, 1234, 2999):
            query = vectors[i] + rng.normal(scale=0.01, size=64).astype(np.float32)
            query /= np.linalg.norm(query)
            similarity, entry = self.index.lookup("many", query, 101.0, 600.0, 0.9)
            assert entry is not None
            self.assertEqual(entry.answer, b"%d" % i)
            self.assertAlmostEqual(similarity, float(np.dot(query, vectors[i] / np.linalg.norm(vectors[i]))), places=5)
        self.index.drop(100 + 1234)
        _, entry = self.index.lookup("many", vectors[1234] / np.linalg.norm(vectors[1234]), 101.0, 600.0, 0.9)
        self.assertIsNone(entry)  # dropped from the index too: random others are far below 0.9

    def test_another_embedding_models_entries_are_not_searched(self) -> None:
        self.index.add(Entry(3, "s", 100.0, unit(0.0, 0.0, 1.0), b"three"), 10)
        _, entry = self.index.lookup("s", unit(0.0, 0.0, 1.0), 101.0, 600.0, 0.9)
        assert entry is not None
        self.assertEqual(entry.answer, b"three")
        _, old = self.index.lookup("s", unit(1.0, 0.0), 101.0, 600.0, 0.9)
        self.assertIsNone(old)  # of two dimensions: made by the model configured before
        self.index.drop(1)  # and dropping one of them is fine
        self.assertEqual(len(self.index), 2)

    def test_the_oldest_go_beyond_max_entries(self) -> None:
        dropped = self.index.add(Entry(3, "t", 100.0, unit(1.0, 0.0), b"three"), 2)
        self.assertEqual(dropped, [1])
        self.assertEqual(len(self.index), 2)
        _, entry = self.index.lookup("s", unit(1.0, 0.0), 101.0, 600.0, 0.9)
        self.assertIsNone(entry)  # "one" is gone; "two" is orthogonal

    def test_vectors_of_another_dimension_never_answer(self) -> None:
        self.assertEqual(self.index.lookup("s", unit(1.0, 0.0, 0.0), 101.0, 600.0, 0.0), (-1.0, None))


class StoreTests(SQLiteStore, SynchronousTestCase):
    def setUp(self) -> None:
        self.db = self.open_store()

    def put(self, created: float, expired_before: float = 0.0, keep: int = 10) -> tuple[int, list[int]]:
        answer = json.dumps({"choices": [{"message": {"content": str(created)}}]}).encode()
        return store.thd_put_cache(self.db, ("s", created, to_blob(unit(1.0, 2.0)), answer), expired_before, keep)

    def test_rows_round_trip_oldest_first(self) -> None:
        first, _ = self.put(1.0)
        second, _ = self.put(2.0)
        rows = store.thd_cache_entries(self.db, 0.0, 10)
        self.assertEqual([r[0] for r in rows], [first, second])
        self.assertEqual(rows[0][1], "s")
        self.assertEqual(from_blob(rows[0][3]).tolist(), unit(1.0, 2.0).tolist())

    def test_bounded_and_expired_rows_go(self) -> None:
        ids = [self.put(float(t))[0] for t in range(1, 4)]
        _, dropped = self.put(4.0, keep=2)
        self.assertEqual(dropped, ids[:2])
        _, dropped = self.put(5.0, expired_before=4.5, keep=10)
        self.assertEqual(dropped, [ids[2], ids[2] + 1])  # created 3.0 and 4.0: before 4.5
        self.assertEqual([r[2] for r in store.thd_cache_entries(self.db, 0.0, 10)], [5.0])

    def test_start_reads_the_live_newest_and_deletes_the_rest(self) -> None:
        for t in range(1, 6):
            self.put(float(t))
        rows = store.thd_cache_entries(self.db, 2.0, 2)
        self.assertEqual([r[2] for r in rows], [4.0, 5.0])
        self.assertEqual(len(store.thd_cache_entries(self.db, 0.0, 100)), 2)
        self.assertEqual(store.thd_purge_cache(self.db, 5.0), 1)


class PostgresStoreTests(PostgresStore, StoreTests):
    pass
