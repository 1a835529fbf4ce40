"""
Vision end to end (issue 39): a generated tiny model with a generated tiny
projector (L{blazar.models.testprojector}) beside it, served by the real
llama-server with C{--mmproj}. Each surface's image form reaches the
engine: the engine's prompt token count grows by the image's tokens over
the same request without it. A text-only model refuses an image with the
teaching 400 in each surface's shape; image URLs to private addresses are
refused; one from a local server is fetched by Blazar (its host listed in
C{image_fetch_private_hosts}), with its type and size bounded.
"""

from __future__ import annotations

import base64
import http.server
import json
import threading
from typing import Any, Callable, Iterator

import pytest

from blazar.models.testmodel import make_test_model
from blazar.models.testprojector import image_tokens, make_test_projector, png_image
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon

PNG = png_image(6, 5, (10, 200, 30))
B64 = base64.b64encode(PNG).decode("ascii")
DATA_URL = "data:image/png;base64," + B64
QUESTION = "what is it?"
MAX_IMAGE_BYTES = 4096


class ImageServer(http.server.ThreadingHTTPServer):
    """
    An image server on loopback that notes who asked for what.
    """

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ImageHandler)
        self.asked: list[tuple[str, str]] = []  # (path, user-agent)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.server_address[1]}{path}"


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    server: ImageServer

    def do_GET(self) -> None:
        self.server.asked.append((self.path, self.headers.get("user-agent", "")))
        if self.path == "/go":
            self.send_response(302)
            self.send_header("location", "/cat.png")
            self.send_header("content-length", "0")
            self.end_headers()
            return
        kind, body = {
            "/cat.png": ("image/png", PNG),
            "/page.html": ("text/html", b"<html>not an image</html>"),
            "/big.png": ("image/png", PNG + b"\0" * (2 * MAX_IMAGE_BYTES)),
        }.get(self.path, ("text/plain", b""))
        self.send_response(200 if body else 404)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def images() -> Iterator[ImageServer]:
    server = ImageServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def vision(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """
    A daemon serving C{seer} (a projector beside it) and C{plain} (none).
    """
    root = tmp_path_factory.mktemp("vision-models")
    models = {"tiny": make_test_model(root / "seer.gguf", seed=3)}
    make_test_model(root / "plain.gguf", seed=4)
    make_test_projector(root / "mmproj-seer-f16.gguf", text_embd=64)
    config = daemon_config(engine, models, "[models.seer]\nparallel = 1\n").replace(
        "ready_timeout = 60\n",
        f'ready_timeout = 60\nimage_fetch_private_hosts = ["127.0.0.1"]\nimage_fetch_max_bytes = {MAX_IMAGE_BYTES}\n',
    )
    d = Daemon(tmp_path_factory.mktemp("vision-daemon"), config)
    d.start()
    try:
        yield d
    finally:
        d.close(check_engines=True)


# each surface: (path, body with the image, body without it, its prompt token count from an answer, error message)
Surface = tuple[
    str, Callable[[str, str | None], dict[str, Any]], Callable[[dict[str, Any]], int], Callable[[dict[str, Any]], str]
]


def _openai(model: str, url: str | None) -> dict[str, Any]:
    content: Any = (
        [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}] if url else QUESTION
    )
    return {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}


def _anthropic(model: str, url: str | None) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
    if url is not None and url.startswith("data:"):
        blocks.insert(0, {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}})
    elif url is not None:
        blocks.insert(0, {"type": "image", "source": {"type": "url", "url": url}})
    return {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": blocks}]}


def _responses(model: str, url: str | None) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "input_text", "text": QUESTION}]
    if url is not None:
        content.append({"type": "input_image", "image_url": url})
    return {"model": model, "max_output_tokens": 16, "store": False, "input": [{"role": "user", "content": content}]}


def _ollama_chat(model: str, url: str | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "user", "content": QUESTION}
    if url is not None:
        message["images"] = [B64]
    return {"model": model, "stream": False, "options": {"num_predict": 1}, "messages": [message]}


def _ollama_generate(model: str, url: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": False, "options": {"num_predict": 1}, "prompt": QUESTION}
    if url is not None:
        body["images"] = [B64]
    return body


def _openai_error(answer: dict[str, Any]) -> str:
    assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
    return str(answer["error"]["message"])


def _anthropic_error(answer: dict[str, Any]) -> str:
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", answer
    return str(answer["error"]["message"])


SURFACES: dict[str, Surface] = {
    "openai": ("/v1/chat/completions", _openai, lambda a: a["usage"]["prompt_tokens"], _openai_error),
    "anthropic": (
        "/v1/messages",
        _anthropic,
        lambda a: a["usage"]["input_tokens"] + a["usage"]["cache_read_input_tokens"],
        _anthropic_error,
    ),
    "responses": ("/v1/responses", _responses, lambda a: a["usage"]["input_tokens"], _openai_error),
    "ollama chat": ("/api/chat", _ollama_chat, lambda a: a["prompt_eval_count"], lambda a: str(a["error"])),
    "ollama generate": ("/api/generate", _ollama_generate, lambda a: a["prompt_eval_count"], lambda a: str(a["error"])),
}


def ask(daemon: Daemon, surface: str, model: str, url: str | None) -> tuple[int, dict[str, Any]]:
    path, body, _, _ = SURFACES[surface]
    return daemon.post_json(path, body(model, url))


def prompt_tokens(daemon: Daemon, surface: str, url: str | None) -> int:
    status, answer = ask(daemon, surface, "seer", url)
    assert status == 200, (surface, answer)
    return int(SURFACES[surface][2](answer))


@pytest.mark.parametrize("surface", list(SURFACES))
def test_each_surfaces_image_reaches_the_engine(vision: Daemon, surface: str) -> None:
    without = prompt_tokens(vision, surface, None)
    assert prompt_tokens(vision, surface, DATA_URL) == without + image_tokens(), surface


def test_the_child_has_the_projector(vision: Daemon) -> None:
    assert prompt_tokens(vision, "openai", None) > 0
    argv = vision.engine_for("seer:latest").cmdline()
    assert argv[argv.index("--mmproj") + 1].endswith("mmproj-seer-f16.gguf")
    status, answer = vision.post_json(
        "/v1/chat/completions",
        {
            "model": "seer",
            "max_tokens": 1,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": QUESTION},
                        {"type": "image_url", "image_url": {"url": DATA_URL}},
                        {"type": "image_url", "image_url": {"url": DATA_URL}},
                    ],
                }
            ],
        },
    )
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == prompt_tokens(vision, "openai", None) + 2 * image_tokens()


@pytest.mark.parametrize("surface", list(SURFACES))
def test_a_text_only_model_refuses_an_image(vision: Daemon, surface: str) -> None:
    status, answer = ask(vision, surface, "plain", DATA_URL)
    assert status == 400, (surface, answer)
    message = SURFACES[surface][3](answer)
    assert "cannot see images" in message and "mmproj" in message and '[models."plain:latest"]' in message, message
    ps = json.loads(vision.request("GET", "/api/ps")[2])
    assert "plain:latest" not in [m["name"] for m in ps["models"]]  # refused before any child started


def test_capabilities_say_vision(vision: Daemon) -> None:
    for name, seen in (("seer", True), ("plain", False)):
        status, shown = vision.post_json("/api/show", {"model": name})
        assert status == 200 and ("vision" in shown["capabilities"]) is seen, shown
    status, _, body = vision.request("GET", "/v1/models")
    listing = {m["id"]: m["capabilities"] for m in json.loads(body)["data"]}
    assert "vision" in listing["seer:latest"] and "vision" not in listing["plain:latest"], listing
    assert not any("mmproj" in name for name in listing)  # a projector is no model


@pytest.mark.parametrize(
    "url, why",
    [
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://10.0.0.1/cat.png", "private"),
        ("http://[::1]:9/cat.png", "loopback"),
    ],
)
def test_a_private_image_url_is_refused(vision: Daemon, url: str, why: str) -> None:
    for surface in ("openai", "anthropic", "responses"):
        status, answer = ask(vision, surface, "seer", url)
        assert status == 400, (surface, answer)
        message = SURFACES[surface][3](answer)
        assert "not resolve to a public address" in message and "image_fetch_private_hosts" in message, message
        assert f"{why} address" not in message, message  # (the log says what kind of address it was)


def test_a_loopback_name_not_listed_is_refused(vision: Daemon, images: ImageServer) -> None:
    status, answer = ask(vision, "openai", "seer", images.url("/cat.png", host="localhost"))
    assert status == 400 and "not resolve to a public address" in answer["error"]["message"], answer
    assert images.asked == []


def test_an_allowed_local_image_url_is_fetched_by_blazar(vision: Daemon, images: ImageServer) -> None:
    without = prompt_tokens(vision, "openai", None)
    for surface in ("openai", "anthropic", "responses"):
        del images.asked[:]
        assert (
            prompt_tokens(vision, surface, images.url("/cat.png"))
            == prompt_tokens(vision, surface, None) + image_tokens()
        ), surface
        assert images.asked == [("/cat.png", "blazar")], images.asked  # by Blazar, once, not by the engine
    del images.asked[:]
    assert prompt_tokens(vision, "openai", images.url("/go")) == without + image_tokens()  # a redirect, followed
    assert [path for path, _ in images.asked] == ["/go", "/cat.png"]


def test_fetched_images_are_bounded(vision: Daemon, images: ImageServer) -> None:
    for path, needle in [
        ("/page.html", "is not an image (content-type 'text/html')"),
        ("/big.png", "image_fetch_max_bytes"),
        ("/missing.png", "answered HTTP 404"),
    ]:
        status, answer = ask(vision, "openai", "seer", images.url(path))
        assert status == 400 and needle in answer["error"]["message"], (path, answer)


def test_counted_tokens_hold_the_image(vision: Daemon) -> None:
    body = _anthropic("seer", None)
    status, without = vision.post_json("/v1/messages/count_tokens", body)
    assert status == 200, without
    status, counted = vision.post_json("/v1/messages/count_tokens", _anthropic("seer", DATA_URL))
    assert status == 200, counted
    assert counted["input_tokens"] == without["input_tokens"] + image_tokens()
