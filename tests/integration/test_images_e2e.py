"""
Image generation on the same port (issue 23): a generated tiny
random-weight Flux.2-klein model (blazar.models.testimage) served by the
real sd-server built here, through the openai SDK's images.generate and
images.edit: PNGs of the asked size, seeds that repeat, n, URLs served
by Blazar, the wrong models, and a model file sd-server cannot load (a
502 that names the file and the reason).
"""

from __future__ import annotations

import base64
import json
import signal
import struct
import urllib.request
from pathlib import Path
from typing import Iterator

import openai
import pytest

from blazar.models.testimage import make_test_image_model
from blazar.models.testmodel import make_test_model
from tests.integration.harness import Daemon, lane_binary


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    return width, height


def broken_model(path: Path) -> None:
    """
    A well-formed GGUF (Blazar reads its header and routes it by its flux
    architecture) whose tensors are no model stable-diffusion.cpp knows.
    """
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(path, arch="flux")
    w.add_tensor("not.a.diffusion.tensor", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def daemon(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("images")
    models = root / "models"
    models.mkdir()
    _, tae = make_test_image_model(models / "tiny-flux.gguf", root / "tae.gguf")  # flux: the sdcpp lane
    make_test_model(models / "tiny.gguf")
    broken_model(root / "broken.gguf")
    d = Daemon(
        root,
        (
            f'models_dir = "{models}"\nready_timeout = 60\nbreaker_crashes = 1000\n'
            f'[models."tiny-flux"]\nargs = ["--taesd", "{tae}"]\n'
            f'[models."broken-image"]\npath = "{root / "broken.gguf"}"\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
            f'[engines.sdcpp]\nbinary = "{lane_binary("sdcpp")}"\nargs = ["--steps", "1", "--cfg-scale", "1"]\n'
        ),
    )
    d.start()
    yield d
    code = d.stop()
    leftovers = d.leftovers
    d.kill_everything()
    assert code in (0, -signal.SIGTERM), d.log()[-3000:]
    assert leftovers == [], "sd-server outlived the daemon"


def client(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key="none", max_retries=0, timeout=300)


def test_generate_a_64x64_png_with_a_seed_that_repeats(daemon: Daemon) -> None:
    c = client(daemon)
    first = c.images.generate(
        model="tiny-flux",
        prompt="a red fox",
        size="64x64",
        response_format="b64_json",
        extra_body={"seed": 42, "steps": 1},
    )
    assert first.data is not None and len(first.data) == 1
    image = base64.b64decode(first.data[0].b64_json or "")
    assert png_size(image) == (64, 64)
    again = c.images.generate(model="tiny-flux", prompt="a red fox", size="64x64", extra_body={"seed": 42, "steps": 1})
    assert again.data is not None and base64.b64decode(again.data[0].b64_json or "") == image
    two = c.images.generate(model="tiny-flux", prompt="a blue fox", size="64x64", n=2, extra_body={"seed": 7})
    assert two.data is not None and len(two.data) == 2
    status, _, raw = daemon.request("GET", "/v1/models")
    kinds = {m["id"]: m["kind"] for m in json.loads(raw)["data"]}
    assert kinds["tiny-flux:latest"] == "image" and kinds["tiny:latest"] == "chat", kinds
    status, _, metrics = daemon.request("GET", "/metrics")
    assert b'blazar_images_total{key="",model="tiny-flux:latest"} 4.0' in metrics, metrics[-1500:]


def test_an_image_url_served_by_blazar_and_an_edit(daemon: Daemon) -> None:
    c = client(daemon)
    made = c.images.generate(model="tiny-flux", prompt="a hill", size="64x64", response_format="url")
    assert made.data is not None and made.data[0].url is not None
    url = made.data[0].url
    assert url.startswith(f"http://127.0.0.1:{daemon.port}/v1/images/files/"), url
    with urllib.request.urlopen(url, timeout=30) as r:  # no key, as an <img src> fetches it
        assert r.headers["content-type"] == "image/png" and png_size(r.read()) == (64, 64)
    status, _, _ = daemon.request("GET", "/v1/images/files/not-a-token.png")
    assert status == 404
    edited = c.images.edit(
        model="tiny-flux",
        image=(
            "in.png",
            base64.b64decode(
                (c.images.generate(model="tiny-flux", prompt="a hill", size="64x64").data or [])[0].b64_json or ""
            ),
        ),
        prompt="the same hill at night",
        size="64x64",
    )
    assert edited.data is not None and png_size(base64.b64decode(edited.data[0].b64_json or "")) == (64, 64)


def test_the_wrong_models_and_a_model_sd_server_cannot_load(daemon: Daemon) -> None:
    c = client(daemon)
    with pytest.raises(openai.BadRequestError) as wrong:
        c.images.generate(model="tiny", prompt="a fox")
    assert "not an image model" in str(wrong.value)
    with pytest.raises(openai.BadRequestError) as chat:
        c.chat.completions.create(model="tiny-flux", messages=[{"role": "user", "content": "hi"}])
    assert "POST /v1/images/generations" in str(chat.value)
    with pytest.raises(openai.BadRequestError) as size:
        c.images.generate(model="tiny-flux", prompt="a fox", size="huge")
    assert "size" in str(size.value)
    with pytest.raises(openai.APIStatusError) as broken:
        c.images.generate(model="broken-image", prompt="a fox", size="64x64")
    assert broken.value.status_code == 502, broken.value
    message = str(broken.value)
    assert "broken.gguf" in message and "sd-server" in message and "get sd version" in message, message


def test_ollamas_image_fields_on_api_generate(daemon: Daemon) -> None:
    # Ollama's experimental image generation (0.14 to its removal): width, height, steps, options.seed in;
    # the final line's base64 "image" out; a stream is that line alone (sd-server reports no progress)
    body = {"model": "tiny-flux", "prompt": "a fox", "width": 64, "height": 64, "steps": 1, "options": {"seed": 3}}
    status, answer = daemon.post_json("/api/generate", {**body, "stream": False}, timeout=300)
    assert status == 200 and answer["done"] is True, answer
    assert png_size(base64.b64decode(answer["image"])) == (64, 64)
    status, headers, raw = daemon.request("POST", "/api/generate", body, timeout=300)
    lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
    assert status == 200 and headers["content-type"] == "application/x-ndjson" and len(lines) == 1, raw[:300]
    assert base64.b64decode(lines[0]["image"]) == base64.b64decode(answer["image"])  # the same seed
    status, answer = daemon.post_json("/api/generate", {**body, "width": 7, "stream": False})
    assert status == 400 and "width" in answer["error"], answer
    status, _, raw = daemon.request("GET", "/api/tags")
    tags = {m["name"]: m for m in json.loads(raw)["models"]}
    assert tags["tiny-flux:latest"]["kind"] == "image", tags["tiny-flux:latest"]


def big_png(width: int, height: int) -> bytes:
    """
    A black PNG (zlib packs its rows to almost nothing: a small upload of a huge picture).
    """
    import zlib

    rows = zlib.compress(b"".join(b"\x00" + b"\x00\x00\x00" * width for _ in range(height)), 9)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", rows)
        + chunk(b"IEND", b"")
    )


def test_what_would_take_all_the_memory_is_refused(daemon: Daemon) -> None:
    c = client(daemon)
    huge = big_png(3000, 2400)
    assert len(huge) < 200_000
    with pytest.raises(openai.BadRequestError) as edit:
        c.images.edit(model="tiny-flux", image=("big.png", huge), prompt="x")
    assert "3000x2400" in str(edit.value) and "2048" in str(edit.value)
    with pytest.raises(openai.BadRequestError) as text:
        c.images.edit(model="tiny-flux", image=("notes.png", b"not an image at all"), prompt="x")
    assert "could not be read" in str(text.value)
    with pytest.raises(openai.BadRequestError) as long:
        c.images.generate(model="tiny-flux", prompt="a " * 10000, size="16x16")
    assert "at most 4000" in str(long.value)
    status, _, raw = daemon.request(
        "POST", "/v1/images/generations", raw=b'{"model": "tiny-flux", "prompt": "\\ud800"}'
    )
    assert status == 400 and b"surrogate" in raw, raw
    # the url comes from the listener, never from a Host the client sent (one this keyless
    # gateway answers under: another site's name is a 403, issue 36)
    made = c.images.generate(
        model="tiny-flux",
        prompt="a hill",
        size="64x64",
        response_format="url",
        extra_headers={"host": "127.0.0.1:1/x?y="},
    )
    assert made.data is not None and (made.data[0].url or "").startswith(f"http://127.0.0.1:{daemon.port}/v1/images/")
