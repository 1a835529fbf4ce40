"""
Library pulls and pushes against a real distribution server (Debian's
docker-registry on loopback) holding Ollama-format manifests of generated
models, driven by the official C{ollama} Python client pointed at Blazar:
pull with streamed progress, tags, show, copy, push to another repository,
delete, and the pulled model answering through the real llama-server. Then
what must not go wrong: a pull killed halfway resumes without downloading
the parts it had again; a blob with a wrong digest is refused and leaves no
model; a disk too small (a file size limit on the daemon) is a clear error
with nothing half-written.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import ollama
import pytest

from blazar.models import ollama_store as store
from blazar.models.testmodel import make_test_model
from tests.integration.distribution import BlobProxy, DistributionRegistry, digest_of, request, seed
from tests.integration.harness import Daemon, _sigint_default

PART = 1 << 20  # BLAZAR_PULL_MIN_PART: MiB parts, so a few-MiB model is fetched in four


class LibraryDaemon(Daemon):
    """
    A daemon with extra environment and, optionally, a file size limit
    (RLIMIT_FSIZE: a write past it fails with EFBIG, as on a full disk).
    """

    def __init__(self, root: Path, config_text: str, env: dict[str, str], fsize: int | None = None) -> None:
        super().__init__(root, config_text)
        self.env = env
        self.fsize = fsize

    def start(self, wait: bool = True) -> "LibraryDaemon":
        fsize = self.fsize

        def prepare() -> None:
            _sigint_default()
            if fsize is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                env={**os.environ, **self.env},
                preexec_fn=prepare,
            )
        if wait:
            self.wait_healthy()
        return self


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DistributionRegistry]:
    r = DistributionRegistry(tmp_path_factory.mktemp("registry"))
    yield r
    r.close()


@pytest.fixture(scope="module")
def proxy(registry: DistributionRegistry) -> Iterator[BlobProxy]:
    p = BlobProxy(registry.url)
    yield p
    p.close()


@pytest.fixture(scope="module")
def seeded(registry: DistributionRegistry, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """
    The registry's models: C{library/tiny:latest} (a tiny chat model with a
    system prompt, parameters and a license), C{me/big:v1} (a few MiB, for
    the resume and disk tests), C{me/bad:v1} (served corrupted by the
    proxy). Their manifests' bytes, by name.
    """
    root = tmp_path_factory.mktemp("seed")
    tiny = make_test_model(root / "tiny.gguf", seed=11).path.read_bytes()
    big = make_test_model(root / "big.gguf", seed=12, n_embd=256, n_ff=1024, n_head=4).path.read_bytes()
    bad = make_test_model(root / "bad.gguf", seed=13).path.read_bytes()
    return {
        "tiny": seed(
            registry.url,
            "library/tiny",
            "latest",
            [
                (store.MEDIA_MODEL, tiny),
                (store.MEDIA_SYSTEM, b"You are a tiny test model."),
                (store.MEDIA_PARAMS, b'{"top_k": 20}'),
                (store.MEDIA_LICENSE, b"MIT"),
            ],
        ),
        "big": seed(registry.url, "me/big", "v1", [(store.MEDIA_MODEL, big)]),
        "bad": seed(registry.url, "me/bad", "v1", [(store.MEDIA_MODEL, bad)]),
    }


def daemon_for(root: Path, engine: str, registry_url: str, fsize: int | None = None) -> LibraryDaemon:
    (root / "models").mkdir(parents=True, exist_ok=True)
    return LibraryDaemon(
        root,
        (
            f'models_dir = "{root / "models"}"\nollama_models = "{root / "store"}"\nregistry = "{registry_url}"\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
        ),
        {"BLAZAR_PULL_MIN_PART": str(PART)},
        fsize,
    )


@pytest.fixture(scope="module")
def libd(
    engine: str, proxy: BlobProxy, seeded: dict[str, bytes], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LibraryDaemon]:
    d = daemon_for(tmp_path_factory.mktemp("library"), engine, proxy.url)
    d.start()
    yield d
    d.close()


def client_of(d: Daemon) -> ollama.Client:
    return ollama.Client(host=f"http://127.0.0.1:{d.port}", timeout=300)


def tags(client: ollama.Client) -> dict[str | None, Any]:
    return {m.model: m for m in client.list().models}


def blobs(root: Path) -> set[str]:
    folder = root / "store" / "blobs"
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


def test_pull_show_copy_push_delete_and_serve(
    libd: LibraryDaemon, proxy: BlobProxy, seeded: dict[str, bytes], registry: DistributionRegistry
) -> None:
    client = client_of(libd)
    proxy.redirect = True  # blob reads answered with a 307 to a "CDN" path, as registry.ollama.ai does
    try:
        progress = list(client.pull("tiny", stream=True))
    finally:
        proxy.redirect = False
    statuses = [p.status for p in progress]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"], statuses
    assert proxy.redirected >= 4
    manifest = json.loads(seeded["tiny"])
    model = manifest["layers"][0]
    lines = [p for p in progress if p.digest == model["digest"]]
    assert lines[0].status == f"pulling {model['digest'][7:19]}"
    assert lines[-1].total == lines[-1].completed == model["size"]
    assert {p.digest for p in progress if p.digest} == {d["digest"] for d in [*manifest["layers"], manifest["config"]]}

    # /api/tags as Ollama shows it: the manifest's digest, the GGUF's details, the blobs' size
    listed = tags(client)["tiny:latest"]
    assert listed.digest == hashlib.sha256(seeded["tiny"]).hexdigest()
    assert listed.size == sum(d["size"] for d in [*manifest["layers"], manifest["config"]])
    assert (listed.details.format, listed.details.family) == ("gguf", "llama")
    assert listed.details.parameter_size and listed.details.quantization_level
    stored = libd.root / "store" / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    assert stored.read_bytes() == seeded["tiny"]

    shown = client.show("tiny")
    assert shown.details is not None and shown.details.family == "llama"
    assert "completion" in (shown.capabilities or [])

    # it answers through the real llama-server
    reply = client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2})
    assert reply.done and reply.model == "tiny"  # (echoed as spelled)

    # create from it (the flow): a system prompt, parameters and quantize q8_0; the new model
    # is quantized by the engine's llama-quantize and answers with its system prompt and parameters
    before = blobs(libd.root)
    asked = client.chat(
        model="tiny",
        messages=[{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "hi"}],
        options={"num_predict": 2},
    )
    lines = list(
        client.create(
            model="tiny-q8",
            from_="tiny",
            system="You answer in one word.",
            parameters={"num_predict": 3, "temperature": 0},
            quantize="q8_0",
            stream=True,
        )
    )
    assert lines[-1].status == "success", [line.status for line in lines]
    assert any(
        (line.status or "").startswith("quantizing") and (line.status or "").endswith("to Q8_0") for line in lines
    ), [line.status for line in lines]
    made = client.show("tiny-q8")
    assert made.details is not None and made.details.quantization_level == "Q8_0"
    assert "You answer in one word." in (made.modelfile or "") and "num_predict" in (made.parameters or "")
    answer = client.chat(model="tiny-q8", messages=[{"role": "user", "content": "hi"}])
    assert answer.eval_count == 3 and answer.done_reason == "length"  # its num_predict
    assert answer.prompt_eval_count == asked.prompt_eval_count  # its system prompt went in, as if asked with it
    client.delete("tiny-q8")
    assert blobs(libd.root) == before  # the created model's own blobs went with it

    # copy: a manifest naming the same blobs, nothing copied
    client.copy("tiny", "me/tiny2:v2")
    assert "me/tiny2:v2" in tags(client)
    assert blobs(libd.root) == before
    assert (libd.root / "store" / "manifests" / "registry.ollama.ai" / "me" / "tiny2" / "v2").read_bytes() == seeded[
        "tiny"
    ]

    # push to a second repository (the configured registry, through the proxy)
    progress = list(client.push("me/tiny2:v2", stream=True))
    statuses = [p.status for p in progress]
    assert statuses[0] == "retrieving manifest" and statuses[-2:] == ["pushing manifest", "success"], statuses
    assert {p.digest for p in progress if p.digest} == {d["digest"] for d in [*manifest["layers"], manifest["config"]]}
    assert all(p.status == f"pushing {p.digest[7:19]}" for p in progress if p.digest)
    status, _, body = request(
        registry.url, "GET", "/v2/me/tiny2/manifests/v2", headers={"accept": store.MEDIA_MANIFEST}
    )
    assert status == 200 and body == seeded["tiny"]

    # push to the registry a name names, plain http with insecure (as Ollama takes it)
    host = registry.url.removeprefix("http://")
    client.copy("tiny", f"{host}/direct/tiny:v3")
    assert f"{host}/direct/tiny:v3" in tags(client)
    assert client.push(f"{host}/direct/tiny:v3", insecure=True).status == "success"
    assert (
        request(registry.url, "GET", "/v2/direct/tiny/manifests/v3", headers={"accept": store.MEDIA_MANIFEST})[2]
        == seeded["tiny"]
    )

    # delete: the manifests go; the blobs once no manifest names them
    client.delete("me/tiny2:v2")
    client.delete(f"{host}/direct/tiny:v3")
    assert "me/tiny2:v2" not in tags(client) and blobs(libd.root) == before
    client.delete("tiny")
    assert "tiny:latest" not in tags(client)
    assert blobs(libd.root) == set()

    # what was pushed pulls back
    assert client.pull("me/tiny2:v2").status == "success"
    assert tags(client)["me/tiny2:v2"].digest == hashlib.sha256(seeded["tiny"]).hexdigest()
    client.delete("me/tiny2:v2")


def test_pull_errors(libd: LibraryDaemon) -> None:
    client = client_of(libd)
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("nope:1")
    assert e.value.status_code == 404 and "file does not exist" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("a/b/c/d")
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as e:
        client.push("never-pulled")
    assert e.value.status_code == 404


def test_a_blob_with_a_wrong_digest_is_refused_and_leaves_no_model(
    libd: LibraryDaemon, proxy: BlobProxy, seeded: dict[str, bytes]
) -> None:
    client = client_of(libd)
    model = json.loads(seeded["bad"])["layers"][0]["digest"]
    proxy.corrupt.add(model)
    try:
        with pytest.raises(ollama.ResponseError) as e:
            list(client.pull("me/bad:v1", stream=True))
    finally:
        proxy.corrupt.discard(model)
    assert "sha256" in e.value.error and "refused" in e.value.error
    assert "me/bad:v1" not in tags(client)
    assert not (libd.root / "store" / "manifests" / "registry.ollama.ai" / "me" / "bad").exists()
    assert not any(model[7:] in name for name in blobs(libd.root))


def test_a_pull_killed_halfway_resumes_without_fetching_its_parts_again(
    engine: str, proxy: BlobProxy, seeded: dict[str, bytes], tmp_path: Path
) -> None:
    model = json.loads(seeded["big"])["layers"][0]
    digest, total = model["digest"], model["size"]
    assert total >= 4 * PART
    d = daemon_for(tmp_path / "resume", engine, proxy.url)
    d.start()
    try:
        proxy.served.pop(digest, None)
        proxy.rate = 1.5 * PART  # bytes a second: seconds for the whole blob

        def pull() -> None:  # a client of its own, in a thread: the daemon dies under it
            try:
                d.request("POST", "/api/pull", {"model": "me/big:v1"}, timeout=60)
            except Exception:
                pass

        pulling = threading.Thread(target=pull, daemon=True)
        pulling.start()
        deadline = time.monotonic() + 60
        while proxy.served.get(digest, 0) < total * 0.75:  # (each part has written a MiB or more)
            assert time.monotonic() < deadline, proxy.served
            time.sleep(0.05)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGKILL)  # halfway: no chance to tidy up
        d.proc.wait()
        pulling.join(30)
    finally:
        proxy.rate = None
    partial = d.root / "store" / "blobs" / f"sha256-{digest[7:]}-partial"
    parts = [json.loads(p.read_bytes()) for p in sorted(partial.parent.glob(partial.name + "-*"))]
    assert len(parts) == 4, parts
    recorded = sum(p["Completed"] for p in parts)
    assert 0 < recorded < total, parts
    assert not (d.root / "store" / "manifests").exists()

    d.start()
    try:
        client = client_of(d)
        proxy.served.pop(digest, None)
        progress = list(client.pull("me/big:v1", stream=True))
        first = next(p for p in progress if p.digest == digest)
        assert first.completed == recorded
        assert proxy.served[digest] == total - recorded  # the completed bytes were not fetched again
        assert progress[-1].status == "success"
        assert tags(client)["me/big:v1"].digest == hashlib.sha256(seeded["big"]).hexdigest()
        blob = d.root / "store" / "blobs" / f"sha256-{digest[7:]}"
        assert digest_of(blob.read_bytes()) == digest
        assert not list(blob.parent.glob("*partial*"))
    finally:
        d.close()


def test_a_full_disk_is_a_clear_error_with_nothing_half_written(
    engine: str, proxy: BlobProxy, seeded: dict[str, bytes], tmp_path: Path
) -> None:
    d = daemon_for(tmp_path / "full", engine, proxy.url, fsize=2 * PART)  # the model's blob is larger
    d.start()
    try:
        client = client_of(d)
        with pytest.raises(ollama.ResponseError) as e:
            list(client.pull("me/big:v1", stream=True))
        assert "file size limit" in e.value.error and "nothing was kept" in e.value.error, e.value.error
        assert "me/big:v1" not in tags(client)
        assert not (d.root / "store" / "manifests").exists()
        assert blobs(d.root) == set()
    finally:
        d.close()
