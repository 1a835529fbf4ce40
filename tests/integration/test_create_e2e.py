"""
Modelfiles and create, for real (issue 39, 2): the official C{ollama}
Python client against a real daemon and real llama-server children. A blob
is uploaded (C{create_blob}), a model is created from it with a system
prompt and parameters, C{show} shows them as Ollama does, and the created
model answers with them applied: SmolLM2-135M-Instruct at temperature 0
gives, with no system message of the request's, the same prompt and the
same answer as the base model asked with that system message; C{num_predict}
caps its answers and C{stop} cuts them, on Ollama's surface and OpenAI's.
Then C{copy} and C{delete}, which takes the blobs no model names any more.

Quantizing (C{quantize: q8_0}) runs the engine's own llama-quantize on a
generated F32 model; it must be beside the llama-server under test (the
build lane builds both): missing is a failure, never a skip.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator, cast

import ollama
import pytest

from blazar.models.testmodel import make_test_model
from tests.integration.harness import Daemon, real_model

QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful assistant."
STORY = "Write a long story about a brave dragon and a little mouse."


@pytest.fixture(scope="module")
def daemon(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("create")
    models = root / "models"
    models.mkdir()
    (models / "smollm.gguf").symlink_to(real_model())
    make_test_model(models / "tiny.gguf")  # an F32 model, a file of its own (for the hard link)
    d = Daemon(
        root,
        (
            f'models_dir = "{models}"\nollama_models = "{root / "store"}"\nready_timeout = 60\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "2"]\n'
            '[models."smollm"]\nparallel = 1\nctx_size = 2048\n'
        ),
    )
    d.start()
    try:
        yield d
    finally:
        d.close(check_engines=True)


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> ollama.Client:
    return ollama.Client(host=f"http://127.0.0.1:{daemon.port}", timeout=300)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def show(daemon: Daemon, model: str) -> dict[str, Any]:
    status, shown = daemon.post_json("/api/show", {"model": model})
    assert status == 200, shown
    return shown


def test_create_show_answer_copy_delete(daemon: Daemon, client: ollama.Client) -> None:
    source = real_model()
    digest = client.create_blob(source)
    assert digest == sha256(source)
    assert daemon.request("HEAD", f"/api/blobs/{digest}")[0] == 200

    lines = list(
        client.create(
            model="paris",
            files={"smollm2.gguf": digest},
            system=SYSTEM,
            stream=True,
            parameters={"temperature": 0, "num_predict": 24, "num_ctx": 2048},
        )
    )
    statuses = cast(list[str], [line.status for line in lines])
    assert statuses[:2] == ["parsing GGUF", f"using existing layer {digest}"], statuses
    assert all(s.startswith(("creating new layer sha256:", "using existing layer sha256:")) for s in statuses[2:4])
    assert statuses[-2:] == ["writing manifest", "success"], statuses
    assert "paris:latest" in [m.model for m in client.list().models]

    shown = client.show("paris")
    assert shown.modelfile is not None and shown.parameters is not None
    assert f"\nSYSTEM {SYSTEM}\n" in shown.modelfile and "\nPARAMETER num_predict 24\n" in shown.modelfile
    assert "num_predict                    24" in shown.parameters.splitlines()
    assert "num_ctx                        2048" in shown.parameters.splitlines()
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert shown.details is not None and shown.details.family == "llama"
    assert show(daemon, "paris")["system"] == SYSTEM

    # its system prompt applies: the prompt and the answer are the base model's asked with that system message
    asked = [{"role": "user", "content": QUESTION}]
    base = client.chat(
        model="smollm",
        messages=[{"role": "system", "content": SYSTEM}, *asked],
        options={"temperature": 0, "num_predict": 24},
    )
    made = client.chat(model="paris", messages=asked)
    assert made.message.content is not None and "Paris" in made.message.content, made.message.content
    assert (made.message.content, made.prompt_eval_count) == (base.message.content, base.prompt_eval_count)
    bare = client.chat(model="smollm", messages=asked, options={"temperature": 0, "num_predict": 24})
    assert bare.prompt_eval_count != made.prompt_eval_count  # (SmolLM2's template puts its own system prompt)
    generated = client.generate(model="paris", prompt=QUESTION)
    assert generated.response == made.message.content

    # num_predict caps an answer; the request's own wins
    story = client.chat(model="paris", messages=[{"role": "user", "content": STORY}])
    assert (story.eval_count, story.done_reason) == (24, "length"), (story.eval_count, story.done_reason)
    short = client.chat(model="paris", messages=[{"role": "user", "content": STORY}], options={"num_predict": 3})
    assert short.eval_count == 3
    # on OpenAI's surface too: one request path
    status, reply = daemon.post_json("/v1/chat/completions", {"model": "paris", "messages": asked})
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"] == made.message.content
    assert reply["usage"]["prompt_tokens"] == made.prompt_eval_count

    # stop cuts the answer where the city would come; the source's other parameters and system are kept
    client.create(model="paris-stop", from_="paris", parameters={"stop": ["Paris"]})
    stopped = client.chat(model="paris-stop", messages=asked)
    assert stopped.message.content is not None
    assert stopped.done_reason == "stop" and "Paris" not in stopped.message.content, stopped.message.content
    assert made.message.content.startswith(stopped.message.content)
    assert show(daemon, "paris-stop")["system"] == SYSTEM

    # copy: the same blobs under another name; delete takes the blobs no model names any more
    client.copy("paris", "paris-copy")
    assert client.chat(model="paris-copy", messages=asked).message.content == made.message.content
    for name in ("paris", "paris-copy", "paris-stop"):
        client.delete(name)
    names = [m.model for m in client.list().models]
    assert not {"paris:latest", "paris-copy:latest", "paris-stop:latest"} & set(names), names
    assert daemon.request("HEAD", f"/api/blobs/{digest}")[0] == 404


def test_quantize_q8_0(daemon: Daemon, client: ollama.Client, engine: str, tmp_path: Path) -> None:
    binary = Path(engine).resolve().with_name("llama-quantize")
    if not binary.is_file():
        pytest.fail(
            f"no llama-quantize beside {engine}: rebuild the engine with the build lane "
            "(python -m blazar.engines.build), which builds both"
        )
    source = make_test_model(tmp_path / "f32.gguf", seed=4).path
    digest = client.create_blob(source)
    lines = list(client.create(model="tiny-q8", files={"f32.gguf": digest}, quantize="q8_0", stream=True))
    quantizing = [line for line in lines if (line.status or "").startswith("quantizing")]
    size = source.stat().st_size
    assert quantizing and all(
        line.status == "quantizing F32 model to Q8_0" and line.digest == "0" * 19 and line.total == size
        for line in quantizing
    ), quantizing
    assert quantizing[-1].completed == size
    statuses = cast(list[str], [line.status for line in lines])
    new = [s for s in statuses if s.startswith("creating new layer")]
    assert statuses[-4:] == ["verifying conversion", new[0], "writing manifest", "success"], statuses
    shown = client.show("tiny-q8")
    assert shown.details is not None and shown.details.quantization_level == "Q8_0"
    status, reply = daemon.post_json(
        "/v1/chat/completions",
        {"model": "tiny-q8", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3},
    )
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply
    client.delete("tiny-q8")


def test_from_a_file_the_legacy_form_and_refusals(daemon: Daemon, client: ollama.Client) -> None:
    # the Modelfile text older clients send; FROM a models_dir file is a hard link into the store
    status, _, body = daemon.request(
        "POST",
        "/api/create",
        {
            "name": "legacy",
            "stream": False,
            "modelfile": 'FROM tiny\nSYSTEM """Be\nbrief."""\nPARAMETER num_predict 2\nPARAMETER stop </s>\n',
        },
    )
    assert (status, json.loads(body)) == (200, {"status": "success"}), body
    shown = show(daemon, "legacy")
    assert shown["system"] == "Be\nbrief." and 'stop                           "</s>"' in shown["parameters"]
    blob = Path(shown["modelfile"].splitlines()[4].removeprefix("FROM "))
    tiny = daemon.root / "models" / "tiny.gguf"
    assert blob.stat().st_ino == tiny.stat().st_ino, (blob, tiny)  # no copy
    reply = client.chat(model="legacy", messages=[{"role": "user", "content": "hello"}])
    assert reply.eval_count is not None and reply.eval_count <= 2

    # a body whose sha256 is not its name is refused and named nothing
    status, _, body = daemon.request("POST", "/api/blobs/sha256:" + "0" * 64, raw=b"not that")
    assert status == 400 and "digest mismatch" in json.loads(body)["error"], body
    assert daemon.request("HEAD", "/api/blobs/sha256:" + "0" * 64)[0] == 404
    with pytest.raises(ollama.ResponseError) as refused:
        client.create(model="nothing", files={"m.gguf": "sha256:" + "0" * 64})
    assert refused.value.status_code == 404 and "upload it first" in str(refused.value)
    with pytest.raises(ollama.ResponseError) as refused:
        client.create(model="smollm", from_="tiny")
    assert refused.value.status_code == 400 and "a file in models_dir" in str(refused.value)
    client.delete("legacy")
    assert tiny.is_file()  # its file in models_dir stays
