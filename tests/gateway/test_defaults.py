"""
The defaults step (L{blazar.gateway.defaults}): a store model's Modelfile
layers on a call, pure; and through every surface in memory, the body the
engine gets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from blazar.gateway.call import Call, CallKind, Run
from blazar.gateway.defaults import apply_model_defaults, model_context
from blazar.models.ollama_store import OllamaLayers, parse_name
from blazar.models.registry import ModelEntry

HELLO = [{"role": "user", "content": "hi"}]


def entry(**layers: Any) -> ModelEntry:
    return ModelEntry(
        "mine:latest",
        Path("/store/blobs/sha256-aa"),
        ollama=OllamaLayers(parse_name("mine"), "sha256:" + "0" * 64, 1, Path("/m"), **layers),
    )


def call(
    kind: CallKind = CallKind.CHAT,
    body: dict[str, Any] | None = None,
    path: str = "/v1/chat/completions",
    **layers: Any,
) -> Run:
    made = Run.of(Call("openai", kind, "mine", path, body if body is not None else {"messages": list(HELLO)}))
    made.entry = entry(**layers)
    return made


class DefaultsTests(SynchronousTestCase):
    def test_a_model_without_layers_is_left_alone(self) -> None:
        plain = Run.of(Call("openai", CallKind.CHAT, "m", "/v1/chat/completions", {"messages": list(HELLO)}))
        self.assertFalse(apply_model_defaults(plain))
        plain.entry = ModelEntry("m:latest", Path("/m.gguf"))
        self.assertFalse(apply_model_defaults(plain))
        self.assertEqual(plain.body, {"messages": HELLO})
        self.assertFalse(apply_model_defaults(call()))

    def test_parameters_are_defaults_as_engine_fields(self) -> None:
        made = call(
            parameters={
                "temperature": 0.5,
                "top_k": 20.0,
                "top_p": 0.9,
                "min_p": 0.05,
                "typical_p": 1,
                "seed": 7,
                "repeat_penalty": 1.1,
                "repeat_last_n": 64,
                "presence_penalty": 0.1,
                "frequency_penalty": 0.2,
                "mirostat": 2,
                "mirostat_tau": 5.0,
                "mirostat_eta": 0.1,
                "num_keep": 4,
                "stop": ["<|im_end|>", "</s>"],
                "num_predict": 32,
                "num_ctx": 8192,
                "num_gpu": 99,
                "use_mmap": False,
            }
        )
        self.assertTrue(apply_model_defaults(made))
        self.assertEqual(
            made.body,
            {
                "messages": HELLO,
                "temperature": 0.5,
                "top_k": 20,
                "top_p": 0.9,
                "min_p": 0.05,
                "typical_p": 1,
                "seed": 7,
                "repeat_penalty": 1.1,
                "repeat_last_n": 64,
                "presence_penalty": 0.1,
                "frequency_penalty": 0.2,
                "mirostat": 2,
                "mirostat_tau": 5.0,
                "mirostat_eta": 0.1,
                "n_keep": 4,
                "stop": ["<|im_end|>", "</s>"],
                "max_tokens": 32,
            },
        )
        self.assertEqual(type(made.body["top_k"]), int)
        self.assertEqual((made.ctx_size, made.max_tokens), (8192, 32))

    def test_what_the_request_set_wins(self) -> None:
        body = {"messages": list(HELLO), "temperature": 0.0, "stop": "x", "max_completion_tokens": 5, "seed": None}
        made = call(
            body=body, parameters={"temperature": 0.9, "stop": ["y"], "num_predict": 100, "seed": 3, "num_ctx": 4096}
        )
        made.ctx_size = 1024
        made.max_tokens = 5
        self.assertTrue(apply_model_defaults(made))
        self.assertEqual(
            made.body, {"messages": HELLO, "temperature": 0.0, "stop": "x", "max_completion_tokens": 5, "seed": 3}
        )
        self.assertEqual((made.ctx_size, made.max_tokens), (1024, 5))

    def test_values_of_the_wrong_kind_are_left_out(self) -> None:
        made = call(
            parameters={
                "temperature": "hot",
                "top_k": 2.5,
                "seed": True,
                "stop": [1],
                "num_predict": -1,
                "num_ctx": 0,
                "unknown": 1,
                "top_p": float("nan"),
            }
        )
        self.assertFalse(apply_model_defaults(made))
        self.assertEqual((made.body, made.ctx_size, made.max_tokens), ({"messages": HELLO}, None, None))

    def test_num_predict_on_infill_and_completions(self) -> None:
        infill = call(
            CallKind.INFILL,
            {"input_prefix": "a", "input_suffix": "b", "prompt": ""},
            "/infill",
            parameters={"num_predict": 8},
            system="not for infill",
        )
        self.assertTrue(apply_model_defaults(infill))
        self.assertEqual(infill.body["n_predict"], 8)
        self.assertIsNone(infill.max_tokens)
        raw = call(
            CallKind.COMPLETION,
            {"prompt": "x"},
            "/v1/completions",
            parameters={"num_predict": 8},
            system="not for raw prompts",
            messages=[{"role": "user", "content": "hi"}],
        )
        self.assertTrue(apply_model_defaults(raw))
        self.assertEqual(raw.body, {"prompt": "x", "max_tokens": 8})

    def test_embeddings_get_the_context_only(self) -> None:
        made = call(
            CallKind.EMBEDDING, {"input": ["x"]}, "/v1/embeddings", parameters={"num_ctx": 512, "temperature": 1}
        )
        self.assertFalse(apply_model_defaults(made))
        self.assertEqual((made.body, made.ctx_size), ({"input": ["x"]}, 512))
        load = call(parameters={"num_ctx": 2048.0})
        model_context(load)
        self.assertEqual(load.ctx_size, 2048)

    def test_system_when_the_chat_has_none(self) -> None:
        made = call(system="Be brief.")
        self.assertTrue(apply_model_defaults(made))
        self.assertEqual(made.body["messages"], [{"role": "system", "content": "Be brief."}, *HELLO])
        for role in ("system", "developer"):
            own = [{"role": "user", "content": "a"}, {"role": role, "content": "mine"}]
            made = call(body={"messages": list(own)}, system="Be brief.")
            self.assertFalse(apply_model_defaults(made))
            self.assertEqual(made.body["messages"], own)

    def test_messages_come_after_the_system_messages(self) -> None:
        history = [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "tool", "content": 5},
            "junk",
        ]
        made = call(system="Be brief.", messages=history)
        self.assertTrue(apply_model_defaults(made))
        self.assertEqual(
            made.body["messages"],
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"},
                *HELLO,
            ],
        )
        own = [{"role": "system", "content": "mine"}, *HELLO]
        made = call(body={"messages": list(own)}, system="Be brief.", messages=history[:2])
        self.assertTrue(apply_model_defaults(made))
        self.assertEqual(made.body["messages"], [own[0], *history[:2], *HELLO])


class ThroughTheSurfacesTests(SynchronousTestCase):
    """
    A store model's system prompt and parameters reach the engine from
    every surface: one step of the one request path.
    """

    def setUp(self) -> None:
        from blazar.models.modelfile import go_json
        from blazar.models.ollama_store import MEDIA_PARAMS, MEDIA_SYSTEM, parse_name, thd_put_model
        from blazar.models.testmodel import make_test_model
        from blazar.testing import FakeSupervisor, fake_engine_app
        from tests.web.gateway import MemoryGateway

        store = Path(self.mktemp()).absolute()
        model = make_test_model(Path(self.mktemp()).absolute() / "x.gguf").path
        thd_put_model(
            store,
            parse_name("mine"),
            model,
            texts={
                MEDIA_SYSTEM: b"You are terse.",
                MEDIA_PARAMS: go_json({"temperature": 0.25, "stop": ["<|im_end|>"], "num_predict": 9, "num_ctx": 1024}),
            },
        )
        asked: list[int | None] = []
        self.asked = asked

        class Recording(FakeSupervisor):
            async def instance_for(self, name: str, ctx_size: int | None = None) -> Any:
                asked.append(ctx_size)
                return await super().instance_for(name, ctx_size)

        self.supervisor = Recording(["m:latest", "mine:latest"])
        self.app = fake_engine_app()
        self.gateway = MemoryGateway(self, self.supervisor, self.app, config=f'ollama_models = "{store}"')

    def sent(self) -> dict[str, Any]:
        return self.app.requests[-1][1]

    def test_every_surface(self) -> None:
        cases: list[tuple[str, dict[str, Any], str, Any]] = [
            ("/v1/chat/completions", {"model": "mine", "messages": HELLO}, "max_tokens", 9),
            ("/api/chat", {"model": "mine", "messages": HELLO, "stream": False}, "max_tokens", 9),
            ("/api/generate", {"model": "mine", "prompt": "hi", "stream": False}, "max_tokens", 9),
            ("/v1/messages", {"model": "mine", "max_tokens": 8, "messages": HELLO}, "max_tokens", 8),
            ("/v1/responses", {"model": "mine", "input": "hi"}, "max_tokens", 9),
        ]
        for path, body, limit, value in cases:
            status, _, data = self.gateway.post(path, body)
            self.assertEqual(status, 200, (path, data))
            sent = self.sent()
            self.assertEqual(sent["messages"][0], {"role": "system", "content": "You are terse."}, path)
            self.assertEqual((sent["temperature"], sent["stop"], sent[limit]), (0.25, ["<|im_end|>"], value), path)
            self.assertEqual(self.asked[-1], 1024, path)

    def test_the_request_wins_and_other_models_are_untouched(self) -> None:
        status, _, data = self.gateway.post(
            "/api/chat",
            {
                "model": "mine",
                "stream": False,
                "options": {"temperature": 0.9, "num_predict": 2, "num_ctx": 4096},
                "messages": [{"role": "system", "content": "Mine."}, *HELLO],
            },
        )
        self.assertEqual(status, 200, data)
        sent = self.sent()
        self.assertEqual([m["content"] for m in sent["messages"]], ["Mine.", "hi"])
        self.assertEqual((sent["temperature"], sent["max_tokens"], self.asked[-1]), (0.9, 2, 4096))
        status, _, data = self.gateway.post("/v1/chat/completions", {"model": "m", "messages": HELLO})
        self.assertEqual(status, 200, data)
        self.assertEqual(json.loads(json.dumps(self.sent())), {"model": "m", "messages": HELLO})
