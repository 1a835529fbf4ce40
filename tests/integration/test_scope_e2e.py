"""
What a scoped key learns about models, end to end on a real daemon: a
model outside its scope gets, on every surface, exactly the answer a model
that does not exist gets (status and body, but for the name), also where
the purpose check (chat to an embedding model) would have answered first;
/api/show shows no path; the listings hold only its models. An admin key
keeps today's answers.
"""

from __future__ import annotations

import http.client
import json
import signal
from typing import Any, Iterator

import pytest

from blazar.models.testmodel import GeneratedModel
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon

ADMIN = "admin-secret-0123456789"
SCOPED = "tiny-secret-0123456789"
HELLO = [{"role": "user", "content": "hi"}]
UNKNOWN = "no-such-model"

# every route that takes a model; "{model}" is replaced by the name asked for
ROUTES: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", "/v1/chat/completions", {"model": "{model}", "messages": HELLO, "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"model": "{model}", "messages": HELLO, "max_tokens": 1, "stream": True}),
    ("POST", "/v1/completions", {"model": "{model}", "prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/embeddings", {"model": "{model}", "input": "hi"}),
    ("GET", "/v1/models/{model}", {}),
    ("POST", "/v1/responses", {"model": "{model}", "input": "hi", "max_output_tokens": 16}),
    ("POST", "/v1/responses/input_tokens", {"model": "{model}", "input": "hi"}),
    ("POST", "/v1/messages", {"model": "{model}", "max_tokens": 1, "messages": HELLO}),
    ("POST", "/v1/messages", {"model": "{model}", "max_tokens": 1, "messages": HELLO, "stream": True}),
    ("POST", "/v1/messages/count_tokens", {"model": "{model}", "messages": HELLO}),
    ("POST", "/api/chat", {"model": "{model}", "messages": HELLO, "stream": False}),
    ("POST", "/api/chat", {"model": "{model}", "messages": HELLO}),
    ("POST", "/api/generate", {"model": "{model}", "prompt": "hi", "stream": False}),
    ("POST", "/api/generate", {"model": "{model}"}),  # a load request
    ("POST", "/api/chat", {"model": "{model}", "keep_alive": 0}),  # an unload request
    ("POST", "/api/embed", {"model": "{model}", "input": "hi"}),
    ("POST", "/api/embeddings", {"model": "{model}", "prompt": "hi"}),
    ("POST", "/api/show", {"model": "{model}"}),
    ("POST", "/api/copy", {"source": "{model}", "destination": "copied"}),
    ("DELETE", "/api/delete", {"model": "{model}"}),
    ("POST", "/api/pull", {"model": "{model}", "stream": False}),
]


@pytest.fixture(scope="module")
def scoped(
    engine: str, models: dict[str, GeneratedModel], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("scope"),
        daemon_config(engine, models)
        + (
            f'[[keys]]\nname = "admin"\nsecret = "{ADMIN}"\n'
            f'[[keys]]\nname = "tinyonly"\nsecret = "{SCOPED}"\nmodels = ["tiny"]\n'
        ),
    )
    d.start()
    yield d
    code = d.stop()
    leftovers = d.leftovers
    d.kill_everything()
    assert code in (0, -signal.SIGTERM), d.log()[-4000:]
    assert leftovers == [], "llama-server outlived the daemon"


def call(d: Daemon, method: str, path: str, body: Any, secret: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=120)
    try:
        conn.request(
            method, path, json.dumps(body) if body else None, {"content-type": "application/json", "x-api-key": secret}
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def route(
    d: Daemon, method: str, path: str, body: dict[str, Any], model: str, secret: str = SCOPED
) -> tuple[int, bytes]:
    return call(
        d, method, path.replace("{model}", model), json.loads(json.dumps(body).replace("{model}", model)), secret
    )


@pytest.mark.parametrize("method, path, body", ROUTES)
def test_out_of_scope_answers_as_unknown(scoped: Daemon, method: str, path: str, body: dict[str, Any]) -> None:
    unknown = route(scoped, method, path, body, UNKNOWN)
    assert unknown[0] in (403, 404), unknown  # 403: management needs an unscoped key, whatever the model
    # cold: a chat model outside the scope; tiny-embed: an embedding model
    # outside it, which the purpose check would have refused by its config fix
    for other in ("cold", "tiny-embed", "Cold:latest"):
        status, data = route(scoped, method, path, body, other)
        assert (status, data.replace(other.encode(), UNKNOWN.encode())) == unknown, (other, data)
        assert b"embedding" not in data and b"cold" not in data.replace(other.encode(), b"").lower()


def test_scoped_not_found_lists_only_its_models(scoped: Daemon) -> None:
    status, data = route(scoped, *ROUTES[0], "cold")
    error = json.loads(data)["error"]
    assert status == 404 and error["code"] == "model_not_found", data
    assert error["message"].endswith("available models: tiny:latest"), error
    status, data = route(scoped, *ROUTES[7], "tiny-embed")
    assert status == 404 and json.loads(data)["error"]["type"] == "not_found_error", data
    status, data = route(scoped, *ROUTES[10], "cold")
    assert (status, json.loads(data)) == (404, {"error": 'model "cold" not found, try pulling it first'})


def test_show_has_no_paths(scoped: Daemon, models: dict[str, GeneratedModel]) -> None:
    status, data = route(scoped, "POST", "/api/show", {"model": "{model}"}, "tiny")
    assert status == 200, data
    shown = json.loads(data)
    assert "\nFROM tiny:latest\n" in shown["modelfile"], shown["modelfile"]
    folder = models["tiny"].path.parent
    for part in (str(folder), str(folder.parent), "/tmp/", "tiny.gguf"):
        assert part.encode() not in data, part
    assert shown["details"]["format"] == "gguf" and "completion" in shown["capabilities"]
    # an admin key still sees where the file is
    status, data = route(scoped, "POST", "/api/show", {"model": "{model}"}, "tiny", ADMIN)
    assert status == 200 and f"FROM {models['tiny'].path}" in json.loads(data)["modelfile"]


def test_listings_hold_only_its_models(scoped: Daemon) -> None:
    _, data = call(scoped, "GET", "/v1/models", None, SCOPED)
    assert [m["id"] for m in json.loads(data)["data"]] == ["tiny:latest"]
    _, data = call(scoped, "GET", "/api/tags", None, SCOPED)
    assert [m["name"] for m in json.loads(data)["models"]] == ["tiny:latest"]
    _, data = call(scoped, "GET", "/v1/models", None, ADMIN)
    assert {"cold:latest", "tiny:latest", "tiny-embed:latest"} <= {m["id"] for m in json.loads(data)["data"]}


def test_in_scope_and_admin_answers(scoped: Daemon) -> None:
    status, data = route(scoped, *ROUTES[0], "tiny")
    assert status == 200, data
    _, data = call(scoped, "GET", "/api/ps", None, SCOPED)
    assert [m["name"] for m in json.loads(data)["models"]] == ["tiny:latest"]
    # an admin key keeps the purpose check's config fix and the full list
    status, data = route(scoped, *ROUTES[0], "tiny-embed", ADMIN)
    assert (
        status == 400 and 'embedding = true under [models."tiny-embed:latest"]' in json.loads(data)["error"]["message"]
    ), data
    status, data = route(scoped, *ROUTES[0], UNKNOWN, ADMIN)
    assert status == 404 and "cold:latest" in json.loads(data)["error"]["message"], data
