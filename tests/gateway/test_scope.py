"""
What a scoped key learns about models, through every surface in memory
(StubTreq over AuthGate and the real surfaces, a fake engine): a model
outside its scope is answered exactly as one that does not exist (the
same status and body but for the name it asked for), before the purpose
check; its 404s list only its models; no answer to it holds a file path.
Admin keys and a gateway without keys keep their answers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from klein import Klein
from twisted.internet.defer import Deferred, fail
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import KeyConfig, parse_config
from blazar.engines.client import EngineClient
from blazar.engines.supervisor import Supervisor
from blazar.gateway.quota import QuotaExceeded
from blazar.gateway.scope import redact, redact_value, resolve_in_scope, visible
from blazar.models.registry import ModelNotFound, ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.service import build_gateway
from blazar.testing import FakeSupervisor, StubEngineClient, fake_process_reactor
from blazar.web.auth import AuthGate, KeyHolder
from blazar.web.client import context_of
from tests.typed import StubTreq

ADMIN = "admin-secret-0123456789"
SCOPED = "scoped-secret-0123456789"
# where the fake engine says its file is, when asked to fail
ENGINE_PATH = "/srv/blazar/models/mine.gguf"
HELLO = [{"role": "user", "content": "hi"}]

# (method, path, body with the model name as "{model}"): every route that
# takes a model
ROUTES: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", "/v1/chat/completions", {"model": "{model}", "messages": HELLO}),
    ("POST", "/v1/chat/completions", {"model": "{model}", "messages": HELLO, "stream": True}),
    ("POST", "/v1/completions", {"model": "{model}", "prompt": "hi"}),
    ("POST", "/v1/embeddings", {"model": "{model}", "input": "hi"}),
    ("GET", "/v1/models/{model}", {}),
    ("POST", "/v1/responses", {"model": "{model}", "input": "hi"}),
    ("POST", "/v1/responses", {"model": "{model}", "input": "hi", "stream": True}),
    ("POST", "/v1/responses/input_tokens", {"model": "{model}", "input": "hi"}),
    ("POST", "/v1/messages", {"model": "{model}", "max_tokens": 8, "messages": HELLO}),
    ("POST", "/v1/messages", {"model": "{model}", "max_tokens": 8, "messages": HELLO, "stream": True}),
    ("POST", "/v1/messages/count_tokens", {"model": "{model}", "messages": HELLO}),
    ("POST", "/api/chat", {"model": "{model}", "messages": HELLO, "stream": False}),
    ("POST", "/api/chat", {"model": "{model}", "messages": HELLO}),
    ("POST", "/api/generate", {"model": "{model}", "prompt": "hi", "stream": False}),
    ("POST", "/api/chat", {"model": "{model}"}),  # a load request
    ("POST", "/api/generate", {"model": "{model}", "keep_alive": 0}),  # an unload request
    ("POST", "/api/embed", {"model": "{model}", "input": "hi"}),
    ("POST", "/api/embeddings", {"model": "{model}", "prompt": "hi"}),
    ("POST", "/api/show", {"model": "{model}"}),
    ("POST", "/api/copy", {"source": "{model}", "destination": "copied"}),
    ("DELETE", "/api/delete", {"model": "{model}"}),
    ("POST", "/api/pull", {"model": "{model}", "stream": False}),
]


def engine_app() -> Klein:
    """
    A llama-server stand-in: a chat reply, or (C{"chat_template_kwargs": {"fail": N}}) an error
    whose text names a file, as the engine's own messages can.
    """
    app = Klein()

    @app.route("/v1/chat/completions", methods=["POST"])
    def chat(request: Any) -> bytes:
        body = json.loads(request.content.read())
        fail = (body.get("chat_template_kwargs") or {}).get("fail")
        if fail:
            request.setResponseCode(fail)
            return json.dumps(
                {
                    "error": {
                        "code": fail,
                        "type": "server_error",
                        "message": f"failed to open {ENGINE_PATH}: no such file",
                    }
                }
            ).encode()
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(
            {
                "choices": [
                    {"finish_reason": "stop", "index": 0, "message": {"role": "assistant", "content": "Hello"}}
                ],
                "created": 1,
                "model": body.get("model", "mine:latest"),
                "object": "chat.completion",
                "usage": {"completion_tokens": 1, "prompt_tokens": 2, "total_tokens": 3},
            }
        ).encode()

    return app


class ScopeSurfaceTests(SynchronousTestCase):
    """
    A gateway with an admin key and a key scoped to C{mine},
    C{minevec} (an embedding model) and C{broken} (not a GGUF file);
    C{theirs} and C{theirvec} (an embedding model) are outside its scope.
    """

    keys = (
        f'[[keys]]\nname = "admin"\nsecret = "{ADMIN}"\n'
        f'[[keys]]\nname = "scoped"\nsecret = "{SCOPED}"\nmodels = ["mine", "minevec", "broken"]\n'
    )

    def setUp(self) -> None:
        self.root = Path(self.mktemp()).absolute()
        for name, embedding in (("mine", False), ("minevec", True), ("theirs", False), ("theirvec", True)):
            make_test_model(self.root / f"{name}.gguf", embedding=embedding)
        (self.root / "broken.gguf").write_bytes(b"not a GGUF file")
        self.reactor = fake_process_reactor()
        config = parse_config(
            f'models_dir = "{self.root}"\n'
            '[models."minevec"]\nembedding = true\n[models."theirvec"]\nembedding = true\n' + self.keys
        )
        self.engine = StubTreq(engine_app().resource())
        names = ["broken:latest", "mine:latest", "minevec:latest", "theirs:latest", "theirvec:latest"]
        registry = ModelRegistry(config, self.reactor)
        router = build_gateway(
            registry,
            cast(Supervisor, FakeSupervisor(names)),
            cast(EngineClient, StubEngineClient(self.engine)),
            self.reactor,
            lambda: config,
            wall=lambda: 0.0,
        ).router()
        self.client = StubTreq(AuthGate(router, KeyHolder(config)))

    def call(self, method: str, path: str, body: dict[str, Any], secret: str | None) -> tuple[int, bytes, bytes]:
        """
        @return: (status, content-type, body).
        """
        headers = {"x-api-key": secret} if secret else {}
        d = self.client.request(
            method,
            "http://localhost" + path,
            data=json.dumps(body).encode() if body else None,
            headers=headers,
        )
        for _ in range(20):
            self.client.flush()
            self.engine.flush()
        response = self.successResultOf(d)
        content = self.successResultOf(response.content())
        return response.code, (response.headers.getRawHeaders("content-type") or [b""])[0], content

    def route(
        self, method: str, path: str, body: dict[str, Any], model: str, secret: str | None = SCOPED
    ) -> tuple[int, bytes, bytes]:
        filled = json.loads(json.dumps(body).replace("{model}", model))
        return self.call(method, path.replace("{model}", model), filled, secret)

    def test_out_of_scope_is_unknown_on_every_surface(self) -> None:
        """
        For the scoped key, each of its own models' spellings aside, a
        model outside its scope (a chat model and an embedding one, so the
        purpose check would have answered first) gets what a model that
        does not exist gets: the same status, content type and body, but
        for the name.
        """
        for method, path, body in ROUTES:
            unknown = self.route(method, path, body, "nope")
            self.assertIn(unknown[0], (403, 404), (path, body, unknown))
            for other in ("theirs", "theirvec", "Theirs:latest"):
                status, kind, data = self.route(method, path, body, other)
                self.assertEqual((status, kind, data.replace(other.encode(), b"nope")), unknown, (path, body, other))
                self.assertNotIn(b"their", data.replace(other.encode(), b"nope").lower())

    def test_scoped_not_found_lists_only_its_models(self) -> None:
        for model in ("nope", "theirs"):
            status, _, data = self.route("POST", "/v1/chat/completions", ROUTES[0][2], model)
            self.assertEqual(status, 404)
            error = json.loads(data)["error"]
            self.assertEqual((error["code"], error["param"]), ("model_not_found", "model"))
            self.assertIn("available models: broken:latest, mine:latest, minevec:latest", error["message"])
            self.assertNotIn("their", error["message"].replace(model, ""))
            status, _, data = self.route("POST", "/v1/messages", ROUTES[8][2], model)
            self.assertEqual(status, 404)
            error = json.loads(data)["error"]
            self.assertEqual(error["type"], "not_found_error")
            self.assertIn("broken:latest, mine:latest, minevec:latest)", error["message"])
            status, _, data = self.route("POST", "/api/chat", ROUTES[11][2], model)
            self.assertEqual(
                (status, json.loads(data)), (404, {"error": f'model "{model}" not found, try pulling it first'})
            )

    def test_scoped_listings(self) -> None:
        _, _, data = self.call("GET", "/v1/models", {}, SCOPED)
        self.assertEqual(
            [m["id"] for m in json.loads(data)["data"]], ["broken:latest", "mine:latest", "minevec:latest"]
        )
        _, _, data = self.call("GET", "/api/tags", {}, SCOPED)
        # (broken is skipped: not a readable GGUF)
        self.assertEqual([m["name"] for m in json.loads(data)["models"]], ["mine:latest", "minevec:latest"])
        _, _, data = self.call("GET", "/v1/models", {}, ADMIN)
        self.assertEqual(len(json.loads(data)["data"]), 5)

    def test_in_scope_models_answer(self) -> None:
        status, _, data = self.route("POST", "/v1/chat/completions", ROUTES[0][2], "mine")
        self.assertEqual(status, 200, data)
        status, _, data = self.route("POST", "/api/chat", ROUTES[11][2], "Mine:latest")
        self.assertEqual(status, 200, data)
        # its own embedding model: the purpose check, with the config fix
        status, _, data = self.route("POST", "/v1/chat/completions", ROUTES[0][2], "minevec")
        self.assertEqual(status, 400, data)
        self.assertEqual(json.loads(data)["error"]["code"], "model_not_supported")
        self.assertIn('[models."minevec:latest"]', json.loads(data)["error"]["message"])
        # management needs an unscoped key, whatever the model
        status, _, data = self.route("DELETE", "/api/delete", {"model": "{model}"}, "mine")
        self.assertEqual(status, 403, data)

    def test_admin_keeps_todays_answers(self) -> None:
        status, _, data = self.route("POST", "/v1/chat/completions", ROUTES[0][2], "theirs", ADMIN)
        self.assertEqual(status, 200, data)
        status, _, data = self.route("POST", "/v1/chat/completions", ROUTES[0][2], "theirvec", ADMIN)
        self.assertEqual(status, 400, data)
        self.assertIn("embedding = true", json.loads(data)["error"]["message"])
        status, _, data = self.route("POST", "/v1/chat/completions", ROUTES[0][2], "nope", ADMIN)
        self.assertEqual(status, 404)
        self.assertIn("theirs:latest, theirvec:latest", json.loads(data)["error"]["message"])
        status, _, data = self.route("POST", "/api/embed", {"model": "{model}", "input": "hi"}, "theirs", ADMIN)
        self.assertEqual(status, 400, data)
        self.assertIn("not an embedding model", json.loads(data)["error"])

    def test_show_has_no_paths_for_a_scoped_key(self) -> None:
        status, _, data = self.route("POST", "/api/show", {"model": "{model}"}, "mine")
        self.assertEqual(status, 200, data)
        shown = json.loads(data)
        self.assertEqual(shown["modelfile"].splitlines()[4], "FROM mine:latest")  # (after Ollama's header)
        self.assertNotIn(str(self.root).encode(), data)
        self.assertNotIn(b"mine.gguf", data)
        self.assertEqual(shown["model_info"]["general.architecture"], "llama")
        status, _, data = self.route("POST", "/api/show", {"model": "{model}"}, "mine", ADMIN)
        self.assertEqual(status, 200, data)
        self.assertIn(f"FROM {self.root / 'mine.gguf'}", json.loads(data)["modelfile"])

    def test_engine_and_gguf_errors_have_no_paths_for_a_scoped_key(self) -> None:
        failing = {"model": "{model}", "messages": HELLO, "chat_template_kwargs": {"fail": 400}}
        cases: list[tuple[str, str, dict[str, Any], str]] = [
            # the engine's text (a 4xx, a 5xx), a GGUF reader's
            ("POST", "/v1/chat/completions", failing, "mine"),
            ("POST", "/v1/chat/completions", {**failing, "chat_template_kwargs": {"fail": 503}}, "mine"),
            ("POST", "/api/show", {"model": "{model}"}, "broken"),
            ("POST", "/v1/chat/completions", {"model": "{model}", "messages": HELLO, "max_tokens": 8}, "broken"),
            ("POST", "/v1/messages", {"model": "{model}", "messages": HELLO, "max_tokens": 8}, "broken"),
        ]
        for method, path, body, model in cases:
            status, _, data = self.route(method, path, body, model)
            self.assertGreaterEqual(status, 400, (path, data))
            text = data.decode()
            self.assertNotIn(str(self.root), text, (path, body))
            self.assertNotIn("/srv/blazar", text, (path, body))
            status, _, admin = self.route(method, path, body, model, ADMIN)
            if model == "broken":
                # an unreadable model file is named by its model, for every key (issue 35)
                for answer in (text, admin.decode()):
                    self.assertIn("broken:latest", answer, (path, answer))
                    self.assertNotIn("broken.gguf", answer, (path, answer))
                    self.assertNotIn(str(self.root), answer, (path, answer))
            else:
                self.assertIn("mine.gguf", text, (path, text))
                self.assertTrue(str(self.root) in admin.decode() or ENGINE_PATH in admin.decode(), (path, admin))

    def test_stream_errors_have_no_paths_for_a_scoped_key(self) -> None:
        # a cold model: the 200 and its loading comments are out when the engine fails
        for secret, shown in ((SCOPED, "failed to open mine.gguf"), (ADMIN, f"failed to open {ENGINE_PATH}")):
            status, _, data = self.route(
                "POST",
                "/v1/chat/completions",
                {"model": "{model}", "messages": HELLO, "stream": True, "chat_template_kwargs": {"fail": 400}},
                "mine",
                secret,
            )
            self.assertIn(shown.encode(), data)
            if secret == SCOPED:
                self.assertNotIn(b"/srv/", data)


class KeylessScopeTests(ScopeSurfaceTests):
    """
    A gateway without keys: everything is visible, as before.
    """

    keys = ""

    def test_out_of_scope_is_unknown_on_every_surface(self) -> None:
        status, _, data = self.route("POST", "/v1/chat/completions", ROUTES[0][2], "theirs", None)
        self.assertEqual(status, 200, data)
        status, _, data = self.route("POST", "/v1/chat/completions", ROUTES[0][2], "theirvec", None)
        self.assertEqual(status, 400, data)

    def test_scoped_not_found_lists_only_its_models(self) -> None:
        status, _, data = self.route("POST", "/v1/chat/completions", ROUTES[0][2], "nope", None)
        self.assertEqual(status, 404)
        self.assertIn(
            "broken:latest, mine:latest, minevec:latest, theirs:latest, theirvec:latest",
            json.loads(data)["error"]["message"],
        )

    def test_scoped_listings(self) -> None:
        _, _, data = self.call("GET", "/v1/models", {}, None)
        self.assertEqual(len(json.loads(data)["data"]), 5)

    def test_in_scope_models_answer(self) -> None:
        pass

    def test_admin_keeps_todays_answers(self) -> None:
        status, _, data = self.route("POST", "/api/show", {"model": "{model}"}, "theirs", None)
        self.assertEqual(status, 200, data)
        self.assertIn(str(self.root), json.loads(data)["modelfile"])

    def test_show_has_no_paths_for_a_scoped_key(self) -> None:
        pass

    def test_engine_and_gguf_errors_have_no_paths_for_a_scoped_key(self) -> None:
        status, _, data = self.route("POST", "/api/show", {"model": "{model}"}, "broken", None)
        self.assertEqual(status, 502)
        self.assertIn('model "broken:latest": its file is not a readable GGUF file', json.loads(data)["error"])
        self.assertNotIn(str(self.root), data.decode())  # the model is named, not its file (issue 35)

    def test_stream_errors_have_no_paths_for_a_scoped_key(self) -> None:
        pass


class FakeRequest:
    def __init__(self, key: KeyConfig | None) -> None:
        context_of(self).key = key


class ResolveInScopeTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.root = Path(self.mktemp())
        for name in ("a", "b"):
            make_test_model(self.root / f"{name}.gguf")
        self.registry = ModelRegistry(parse_config(f'models_dir = "{self.root}"'), fake_process_reactor())

    def resolve(self, request: Any, name: object) -> Any:
        d = resolve_in_scope(context_of(request), self.registry, name)
        from twisted.internet.defer import ensureDeferred

        return ensureDeferred(d)

    def test_scope_before_rates_and_rates_once(self) -> None:
        calls: list[int] = []

        def rates() -> Deferred[None]:
            calls.append(1)
            return fail(QuotaExceeded("over", 5))

        request = FakeRequest(KeyConfig("s", "x" * 16, models=("a:latest",)))
        context_of(request).rates = rates
        for name in ("b", "nope", 7, "bad name!"):
            failure = self.failureResultOf(self.resolve(request, name), ModelNotFound)
            self.assertEqual(failure.value.available, ["a:latest"])
        self.assertEqual(calls, [])
        self.failureResultOf(self.resolve(request, "A"), QuotaExceeded)
        self.assertEqual(self.successResultOf(self.resolve(request, "a")).name, "a:latest")  # counted once
        self.assertEqual(calls, [1])
        self.assertEqual(context_of(request).model, "a:latest")

    def test_out_of_scope_rescans_as_unknown_does(self) -> None:
        """
        A name outside the scope is not looked up: the registry is scanned
        again, as for a name that does not exist, so a model added since
        the last scan is listed by both.
        """
        request = FakeRequest(KeyConfig("s", "x" * 16, models=("a:latest", "c:latest")))
        self.successResultOf(self.resolve(request, "a"))
        make_test_model(self.root / "c.gguf")
        failure = self.failureResultOf(self.resolve(request, "b"), ModelNotFound)
        self.assertEqual((failure.value.name, failure.value.available), ("b", ["a:latest", "c:latest"]))

    def test_remote_models_with_colons_and_slashes(self) -> None:
        """
        The example in docs/remotes.md (issue 36): a key scoped to
        C{peer:qwen3:8b}, a remote's model whose id has its own C{:}, is
        accepted by the config and reaches that model (and C{router:meta/llama},
        an id with C{/}); another of the remote's models stays unknown to it.
        """
        config = parse_config(
            f'models_dir = "{self.root}"\n'
            '[[remotes]]\nname = "peer"\nbase_url = "http://127.0.0.1:9/v1"\nmodels = ["qwen3:8b", "other:1b"]\n'
            '[[remotes]]\nname = "router"\nbase_url = "http://127.0.0.1:9/v1"\nmodels = ["meta/llama"]\n'
            '[[keys]]\nname = "webui"\nsecret = "' + "s" * 16 + '"\nmodels = ["peer:qwen3:8b", "router:meta/llama"]\n'
        )
        (key,) = config.keys
        self.assertEqual(key.models, ("peer:qwen3:8b", "router:meta/llama"))
        self.registry = ModelRegistry(config, fake_process_reactor())
        request = FakeRequest(key)
        self.assertEqual(self.successResultOf(self.resolve(request, "peer:qwen3:8b")).remote_model, "qwen3:8b")
        self.assertEqual(self.successResultOf(self.resolve(request, "Router:meta/llama")).remote_model, "meta/llama")
        failure = self.failureResultOf(self.resolve(request, "peer:other:1b"), ModelNotFound)
        self.assertEqual(failure.value.available, ["peer:qwen3:8b", "router:meta/llama"])
        self.failureResultOf(self.resolve(request, "peer:QWEN3:8b"), ModelNotFound)

    def test_unscoped_and_keyless_see_everything(self) -> None:
        for key in (None, KeyConfig("admin", "y" * 16)):
            request = FakeRequest(key)
            self.assertEqual(self.successResultOf(self.resolve(request, "b")).name, "b:latest")
            failure = self.failureResultOf(self.resolve(request, "nope"), ModelNotFound)
            self.assertEqual(failure.value.available, ["a:latest", "b:latest"])
            self.assertEqual(visible(context_of(request), ["a:latest", "b:latest"]), ["a:latest", "b:latest"])
            self.assertEqual(redact(context_of(request), "/srv/m/a.gguf"), "/srv/m/a.gguf")
        scoped = FakeRequest(KeyConfig("s", "x" * 16, models=("B",)))
        self.assertEqual(visible(context_of(scoped), ["a:latest", "b:latest"]), ["b:latest"])


class RedactTests(SynchronousTestCase):
    scoped = FakeRequest(KeyConfig("s", "x" * 16, models=("m:latest",)))

    def test_paths_cut_to_their_last_component(self) -> None:
        cases = {
            "/srv/models/m.gguf: not a readable GGUF file": "m.gguf: not a readable GGUF file",
            "failed to open '/home/u/.cache/x/m.gguf'": "failed to open 'm.gguf'",
            "binary = ~/.cache/blazar/engines/bin/llama-server": "binary = llama-server",
            "socket (/run/blazar/run/m.sock) refused": "socket (m.sock) refused",
            "C:\\models\\m.gguf missing": "m.gguf missing",
            "path:/a/b/c": "path:c",
        }
        for text, shown in cases.items():
            self.assertEqual(redact(context_of(self.scoped), text), shown)

    def test_names_and_urls_left_alone(self) -> None:
        for text in (
            "model 'hf.co/user/repo:Q4_K_M' not found",
            "see https://huggingface.co/user/repo/tree/main",
            "library/qwen:7b and ns/model",
            "a / b and 1/2/3",
        ):
            self.assertEqual(redact(context_of(self.scoped), text), text)

    def test_metadata_values(self) -> None:
        kv = {
            "quantize.imatrix.file": "/data/imatrix/m.dat",
            "general.name": "m",
            "list": ["/a/b/c", 1],
            "n": 4,
            "none": None,
        }
        self.assertEqual(
            redact_value(context_of(self.scoped), kv),
            {
                "quantize.imatrix.file": "m.dat",
                "general.name": "m",
                "list": ["c", 1],
                "n": 4,
                "none": None,
            },
        )
