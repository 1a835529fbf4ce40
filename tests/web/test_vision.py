"""
Images on every surface (issue 39, vision): each surface's image form
reaches the engine as an OpenAI C{image_url} part for a model with a
projector; for a model without one it is a 400 in the surface's own shape
that names the fix, and the engine is never asked; image URLs are fetched
by Blazar (the pipeline's vision step), never handed to the engine.
"""

from __future__ import annotations

import base64
import json
from typing import Any, cast

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import parse_config
from blazar.gateway.imagefetch import ImageFetcher, ImageFetchError
from blazar.gateway.operations import ModelOperations
from blazar.gateway.pipeline import MEDIA_PARTS
from blazar.models.testprojector import make_test_projector, png_image
from blazar.testing import FakeSupervisor, fake_engine_app
from blazar.web.ollama import OllamaSurface
from blazar.web.openai import OpenAISurface
from tests.typed import StubTreq
from tests.web.gateway import MemoryGateway

PNG = base64.b64encode(png_image()).decode("ascii")
DATA_URL = "data:image/png;base64," + PNG


class FakeFetcher:
    """
    An L{blazar.gateway.imagefetch.ImageFetcher} that answers every URL
    with L{PNG}, or refuses the ones in C{refuse}.
    """

    def __init__(self) -> None:
        self.fetched: list[tuple[str, str, int]] = []
        self.refuse: set[str] = set()
        self.seconds: list[float | None] = []  # the time left each fetch was given
        self.taking: tuple[Any, float] | None = None  # (clock, seconds): each fetch advances the clock so

    async def fetch(self, url: str, where: str, budget: int, seconds: float | None = None) -> tuple[str, int]:
        self.fetched.append((url, where, budget))
        self.seconds.append(seconds)
        if self.taking is not None:
            clock, taken = self.taking
            clock.advance(taken)
        if url in self.refuse:
            raise ImageFetchError(f"image URL {url!r}: refused", where)
        return DATA_URL, 100


def image_requests(model: str, image: dict[str, str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """
    One request per surface that sends C{model} the image C{image}
    (C{{"data": base64}} or C{{"url": ...}}) in that surface's own form.
    """
    url = image.get("url") or "data:image/png;base64," + image["data"]
    anthropic_source = (
        {"type": "url", "url": image["url"]}
        if "url" in image
        else {"type": "base64", "media_type": "image/png", "data": image["data"]}
    )
    requests: dict[str, tuple[str, dict[str, Any]]] = {
        "openai": (
            "/v1/chat/completions",
            {
                "model": model,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is it?"},
                            {"type": "image_url", "image_url": {"url": url}},
                        ],
                    }
                ],
            },
        ),
        "anthropic": (
            "/v1/messages",
            {
                "model": model,
                "max_tokens": 8,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": anthropic_source},
                            {"type": "text", "text": "what is it?"},
                        ],
                    }
                ],
            },
        ),
        "responses": (
            "/v1/responses",
            {
                "model": model,
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "what is it?"},
                            {"type": "input_image", "image_url": url},
                        ],
                    }
                ],
            },
        ),
    }
    if "data" in image:
        requests["ollama chat"] = (
            "/api/chat",
            {
                "model": model,
                "stream": False,
                "messages": [{"role": "user", "content": "what is it?", "images": [image["data"]]}],
            },
        )
        requests["ollama generate"] = (
            "/api/generate",
            {"model": model, "stream": False, "prompt": "what is it?", "images": [image["data"]]},
        )
    return requests


def error_message(surface: str, body: bytes) -> str:
    """
    The message of an error answer, from the surface's own shape.
    """
    parsed = json.loads(body)
    if surface.startswith("ollama"):
        return str(parsed["error"])
    if surface == "anthropic":
        assert parsed["type"] == "error" and parsed["error"]["type"] == "invalid_request_error", parsed
        return str(parsed["error"]["message"])
    assert set(parsed["error"]) == {"message", "type", "param", "code"}, parsed
    return str(parsed["error"]["message"])


def sent_images(request: dict[str, Any]) -> list[str]:
    """
    The image URLs of an engine request's messages.
    """
    return [
        part["image_url"]["url"]
        for message in request["messages"]
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") == "image_url"
    ]


class VisionSurfaceTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.engine_app = fake_engine_app("seer:latest")
        self.gateway = MemoryGateway(
            self, FakeSupervisor(["seer:latest", "plain:latest"]), self.engine_app, models=("seer", "plain")
        )
        make_test_projector(self.gateway.root / "mmproj-seer-f16.gguf")
        self.gateway.registry.forget()
        self.fetcher = FakeFetcher()
        self.gateway.pipeline.images = cast(ImageFetcher, self.fetcher)

    def test_each_surfaces_image_reaches_the_engine(self) -> None:
        for surface, (path, body) in image_requests("seer", {"data": PNG}).items():
            del self.engine_app.requests[:]
            code, _, answer = self.gateway.post(path, body)
            self.assertEqual(code, 200, (surface, answer))
            (request,) = [r for p, r in self.engine_app.requests if p == "/v1/chat/completions"]
            self.assertEqual(sent_images(request), [DATA_URL], surface)
        self.assertEqual(self.fetcher.fetched, [])

    def test_an_image_for_a_model_without_a_projector_is_a_teaching_400(self) -> None:
        for surface, (path, body) in image_requests("plain", {"data": PNG}).items():
            code, _, answer = self.gateway.post(path, body)
            self.assertEqual(code, 400, (surface, answer))
            message = error_message(surface, answer)
            for needle in (
                "cannot see images",
                "mmproj-plain.gguf",
                'mmproj = "/path/to/mmproj.gguf"',
                '[models."plain:latest"]',
            ):
                self.assertIn(needle, message, surface)
        self.assertEqual(self.engine_app.requests, [])  # never dropped, never sent

    def test_image_urls_are_fetched_by_blazar(self) -> None:
        for surface, (path, body) in image_requests("seer", {"url": "https://img.example/cat.png"}).items():
            del self.engine_app.requests[:]
            code, _, answer = self.gateway.post(path, body)
            self.assertEqual(code, 200, (surface, answer))
            (request,) = [r for p, r in self.engine_app.requests if p == "/v1/chat/completions"]
            self.assertEqual(sent_images(request), [DATA_URL], surface)  # no engine fetches a URL
        self.assertEqual([url for url, _, _ in self.fetcher.fetched], ["https://img.example/cat.png"] * 3)
        url, where, budget = self.fetcher.fetched[0]
        self.assertEqual((where, budget), ("messages[0].content[1].image_url", 20 * 1024 * 1024))

    def test_a_requests_image_urls_share_one_fetch_deadline(self) -> None:
        self.fetcher.taking = (self.gateway.reactor, 4.0)
        url = {"type": "image_url", "image_url": {"url": "https://img.example/cat.png"}}
        code, _, answer = self.gateway.post(
            "/v1/chat/completions",
            {
                "model": "seer",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, url, url, url]}],
            },
        )
        self.assertEqual(code, 200, answer)
        self.assertEqual(self.fetcher.seconds, [10.0, 6.0, 2.0])  # of image_fetch_timeout_secs, in all

    def test_a_refused_url_is_a_400_naming_it(self) -> None:
        self.fetcher.refuse.add("http://10.0.0.1/x.png")
        for surface, (path, body) in image_requests("seer", {"url": "http://10.0.0.1/x.png"}).items():
            code, _, answer = self.gateway.post(path, body)
            self.assertEqual(code, 400, (surface, answer))
            self.assertIn("http://10.0.0.1/x.png", error_message(surface, answer))
        self.assertEqual(self.engine_app.requests, [])

    def test_a_url_for_a_model_without_a_projector_is_not_fetched(self) -> None:
        path, body = image_requests("plain", {"url": "https://img.example/cat.png"})["openai"]
        self.assertEqual(self.gateway.post(path, body)[0], 400)
        self.assertEqual(self.fetcher.fetched, [])

    def test_other_schemes_and_media_urls_are_refused(self) -> None:
        for part, needle in [
            ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "file: URLs are not taken"),
            ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}, "must be base64"),
            ({"type": "input_audio", "input_audio": {"url": "http://10.0.0.1/a.wav"}}, "does not fetch input_audio"),
        ]:
            code, _, answer = self.gateway.post(
                "/v1/chat/completions",
                {"model": "seer", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]},
            )
            self.assertEqual(code, 400, answer)
            self.assertIn(needle, error_message("openai", answer))
        self.assertEqual(self.engine_app.requests, [])

    def media_answer(self, part: dict[str, Any]) -> tuple[int, bytes]:
        code, _, answer = self.gateway.post(
            "/v1/chat/completions",
            {"model": "seer", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]},
        )
        return code, answer

    def test_every_media_value_is_checked_whatever_its_key(self) -> None:
        # llama-server reads data before url, and fetches any value that starts with "http"
        wav, metadata = "data:audio/wav;base64,AAAA", "http://169.254.169.254/"
        for kind in MEDIA_PARTS:
            for media in (
                {"url": wav, "data": metadata},
                {"data": metadata, "url": wav},
                {"url": metadata, "data": wav},
                {"data": wav, "url": metadata},
                {"data": "AAAA", "url": "https://10.0.0.1/a.wav"},
                {"data": "file:///etc/passwd"},
                {"data": "http//169.254.169.254/"},
                {"url": "HTTP://169.254.169.254/"},
            ):
                code, answer = self.media_answer({"type": kind, kind: media})
                self.assertEqual(code, 400, (kind, media, answer))
                self.assertIn(f"does not fetch {kind}", error_message("openai", answer))
        self.assertEqual(self.engine_app.requests, [])

    def test_a_media_part_carries_only_the_value_checked(self) -> None:
        wav = "data:audio/wav;base64,AAAA"
        for kind in MEDIA_PARTS:
            for media, sent in [
                ({"url": wav, "data": "QUJD", "format": "wav"}, {"data": "QUJD", "format": "wav"}),
                ({"data": "QUJD", "url": wav}, {"data": "QUJD"}),
                ({"url": wav, "data": 5}, {"url": wav}),  # the engine reads url when data is no string
                ({"data": wav}, {"data": wav}),
            ]:
                del self.engine_app.requests[:]
                code, answer = self.media_answer({"type": kind, kind: media})
                self.assertEqual(code, 200, (kind, media, answer))
                ((_, request),) = self.engine_app.requests
                self.assertEqual(request["messages"][0]["content"][1], {"type": kind, kind: sent})

    def test_a_bare_http_image_string_is_refused(self) -> None:
        # no scheme, so not fetched by Blazar, yet llama-server would try to fetch it
        code, answer = self.media_answer({"type": "image_url", "image_url": {"url": "http//169.254.169.254/"}})
        self.assertEqual(code, 400, answer)
        self.assertIn("not base64", error_message("openai", answer))
        self.assertEqual((self.engine_app.requests, self.fetcher.fetched), ([], []))

    def test_a_bare_url_string_is_sent_as_the_engine_reads_it(self) -> None:
        code, _, answer = self.gateway.post(
            "/v1/chat/completions",
            {
                "model": "seer",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": DATA_URL}],
                    }
                ],
            },
        )
        self.assertEqual(code, 200, answer)
        ((_, request),) = self.engine_app.requests
        self.assertEqual(request["messages"][0]["content"][1], {"type": "image_url", "image_url": {"url": DATA_URL}})

    def test_without_a_fetcher_urls_are_refused(self) -> None:
        self.gateway.pipeline.images = None
        path, body = image_requests("seer", {"url": "https://img.example/cat.png"})["openai"]
        code, _, answer = self.gateway.post(path, body)
        self.assertEqual(code, 400)
        self.assertIn("base64", error_message("openai", answer))

    def test_ollama_images_with_raw_or_suffix_are_refused(self) -> None:
        for extra in ({"raw": True}, {"suffix": "end"}):
            code, _, answer = self.gateway.post(
                "/api/generate", {"model": "seer", "prompt": "x", "stream": False, "images": [PNG], **extra}
            )
            self.assertEqual(code, 400, answer)
            self.assertIn("images cannot be sent with", error_message("ollama", answer))

    def test_vision_is_a_capability(self) -> None:
        for name, vision in (("seer", True), ("plain", False)):
            code, _, answer = self.gateway.post("/api/show", {"model": name})
            self.assertEqual(code, 200, answer)
            self.assertEqual("vision" in json.loads(answer)["capabilities"], vision, name)
        d = self.gateway.client.get("http://localhost/v1/models")
        for _ in range(5):
            self.gateway.client.flush()
        listing = json.loads(self.successResultOf(self.successResultOf(d).content()))
        self.assertEqual(
            {m["id"]: "vision" in m["capabilities"] for m in listing["data"]},
            {"seer:latest": True, "plain:latest": False},
        )

    def test_the_live_configs_no_mmproj_takes_vision_away_everywhere(self) -> None:
        live = parse_config(f'models_dir = "{self.gateway.root}"\n[engines.llamacpp]\nargs = ["--no-mmproj"]')
        gateway = self.gateway
        openai = StubTreq(
            OpenAISurface(gateway.registry, gateway.pipeline, gateway.reactor, config=lambda: live).app.resource()
        )
        for path in ("/v1/models", "/v1/models/seer:latest"):
            response = self.successResultOf(openai.get("http://localhost" + path))
            answer = json.loads(self.successResultOf(response.content()))
            for model in answer.get("data", [answer]):
                self.assertNotIn("vision", model["capabilities"], (path, model))
        # as /api/show says
        ollama = StubTreq(
            OllamaSurface(
                gateway.registry,
                gateway.pipeline,
                gateway.reactor,
                lambda: 0.0,
                cast(ModelOperations, None),
                lambda: live,
            ).app.resource()
        )
        response = self.successResultOf(ollama.post("http://localhost/api/show", json={"model": "seer"}))
        self.assertNotIn("vision", json.loads(self.successResultOf(response.content()))["capabilities"])

    def test_the_entry_carries_the_projector(self) -> None:
        entry = self.successResultOf(ensureDeferred(self.gateway.registry.resolve("seer")))
        self.assertEqual(entry.projector, self.gateway.root / "mmproj-seer-f16.gguf")
