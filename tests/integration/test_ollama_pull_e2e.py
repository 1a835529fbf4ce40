"""
/api/pull against a local fake hub (nothing here can reach the real one):
progress, sha256 verification, resume, and no half-written model on failure.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Iterator

import ollama
import pytest

from blazar.models.testmodel import make_test_model
from tests.integration.fakehub import FakeHub
from tests.integration.harness import Daemon

REPO = "test/tiny-GGUF"
NAME = "hf.co/test/tiny-GGUF:Q4_K_M"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    root = tmp_path_factory.mktemp("hubfiles")
    data = make_test_model(root / "m.gguf", seed=5).path.read_bytes()
    h = FakeHub({REPO: {"tiny-Q4_K_M.gguf": data, "tiny-Q8_0.gguf": data[::-1]}})
    yield h
    h.close()


@pytest.fixture(scope="module")
def pulld(engine: str, hub: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("pull")
    (root / "models").mkdir()
    d = Daemon(
        root,
        (
            f'models_dir = "{root / "models"}"\nhf_endpoint = "{hub.url}"\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
        ),
    )
    d.start()
    yield d
    code = d.stop()
    d.kill_everything()
    assert code in (0, -signal.SIGTERM)


@pytest.fixture(scope="module")
def client(pulld: Daemon) -> ollama.Client:
    return ollama.Client(host=f"http://127.0.0.1:{pulld.port}")


def names(client: ollama.Client) -> set[str | None]:
    return {m.model for m in client.list().models}


def test_failed_pulls_leave_nothing_then_resume(client: ollama.Client, hub: FakeHub, pulld: Daemon) -> None:
    models_dir = Path(pulld.root / "models")
    # 1. the connection breaks mid-way: an error line, no model
    hub.break_after = 100_000
    with pytest.raises(ollama.ResponseError) as e:
        list(client.pull(NAME, stream=True))
    assert "pull again to resume" in e.value.error
    assert NAME not in names(client)
    partials = list((models_dir / ".partial").iterdir())
    assert len(partials) == 1 and partials[0].stat().st_size == 100_000

    # 2. pull again: resumes from byte 100000, verifies, installs
    progress = list(client.pull(NAME, stream=True))
    assert hub.ranges[-1] == "bytes=100000-"
    statuses = [p.status for p in progress]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert "verifying sha256 digest" in statuses
    downloads = [p for p in progress if p.digest]
    assert downloads[0].completed == 100_000
    assert downloads[-1].total is not None and downloads[-1].completed == downloads[-1].total > 100_000
    assert NAME in names(client)
    assert list((models_dir / ".partial").iterdir()) == []

    # 3. and it serves
    reply = client.chat(model=NAME, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2})
    assert reply.done and reply.model == NAME


def test_corrupt_download_is_rejected(client: ollama.Client, hub: FakeHub, pulld: Daemon) -> None:
    hub.corrupt = True
    try:
        with pytest.raises(ollama.ResponseError) as e:
            list(client.pull("hf.co/test/tiny-GGUF:Q8_0", stream=True))
        assert "sha256 mismatch" in e.value.error
    finally:
        hub.corrupt = False
    assert "hf.co/test/tiny-GGUF:Q8_0" not in names(client)
    assert list((Path(pulld.root / "models") / ".partial").iterdir()) == []


def test_a_vision_repositorys_projector_comes_with_it(
    client: ollama.Client, hub: FakeHub, pulld: Daemon, tmp_path: Path
) -> None:
    from blazar.models.testprojector import make_test_projector

    data = make_test_model(tmp_path / "seer.gguf", seed=7).path.read_bytes()
    projector = make_test_projector(tmp_path / "p.gguf").read_bytes()
    hub.repos["test/seer-GGUF"] = {
        "seer-Q4_K_M.gguf": data,
        "mmproj-seer-BF16.gguf": b"not this one",
        "mmproj-seer-F16.gguf": projector,
    }
    progress = list(client.pull("hf.co/test/seer-GGUF:Q4_K_M", stream=True))
    assert progress[-1].status == "success"
    assert {p.total for p in progress if p.digest} == {len(data), len(projector)}
    folder = Path(pulld.root / "models" / "hf.co" / "test" / "seer-GGUF")
    assert sorted(p.name for p in folder.iterdir()) == ["Q4_K_M.gguf", "mmproj-seer-F16.gguf"]
    assert (folder / "mmproj-seer-F16.gguf").read_bytes() == projector
    assert "vision" in (client.show("hf.co/test/seer-GGUF:Q4_K_M").capabilities or [])


def test_pull_errors(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("a/b/c/llama3")  # (a plain name is a library pull: test_ollama_library_e2e)
    assert e.value.status_code == 400 and "hf.co/" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("hf.co/test/missing-GGUF")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("hf.co/test/tiny-GGUF:Q2_K")
    assert e.value.status_code == 404 and "Q4_K_M" in e.value.error


def test_non_streaming_pull(client: ollama.Client) -> None:
    assert client.pull("hf.co/test/tiny-GGUF:Q4_K_M", stream=False).status == "success"
