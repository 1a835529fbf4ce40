"""
Reranking on the same port (issue 23): a generated tiny reranker GGUF
(rank pooling) served by a llama-server child started with --rerank,
through POST /v1/rerank, /rerank and /v1/reranking.
"""

from __future__ import annotations

import json
import signal
from typing import Any, Iterator

import pytest

from blazar.models.testmodel import make_test_model
from tests.integration.harness import Daemon

DOCS = ["hello world", {"text": "the test model"}, "yes no ok"]


@pytest.fixture(scope="module")
def daemon(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("rerank")
    models = root / "models"
    make_test_model(models / "ranker.gguf", seed=7, rerank=True)  # a reranker by its metadata
    make_test_model(models / "tiny.gguf")
    make_test_model(models / "embed.gguf", seed=1, embedding=True)
    d = Daemon(
        root,
        (
            f'models_dir = "{models}"\n'
            '[models."embed"]\nembedding = true\n'
            '[models."named-ranker"]\npath = "ranker.gguf"\nrerank = true\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
        ),
    )
    d.start()
    yield d
    code = d.stop()
    d.kill_everything()
    assert code in (0, -signal.SIGTERM)
    log = d.log()
    assert "Start it with --slot-save-path" not in log and "listing its slots" not in log, (
        "a KV bank save was tried on a reranker"
    )


def rerank(d: Daemon, path: str = "/v1/rerank", **body: Any) -> tuple[int, dict[str, Any]]:
    status, _, data = d.request("POST", path, {"model": "ranker", "query": "hello", "documents": DOCS, **body})
    return status, json.loads(data)


def test_scores_sorted_top_n_and_repeatable(daemon: Daemon) -> None:
    status, answer = rerank(daemon, return_documents=True)
    assert status == 200, answer
    results = answer["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == 3, results
    texts = ["hello world", "the test model", "yes no ok"]
    assert all(r["document"]["text"] == texts[r["index"]] for r in results)
    assert answer["usage"]["total_tokens"] > 0 and answer["model"] == "ranker"
    for path in ("/rerank", "/v1/reranking", "/v1/rerank"):  # the same order every time, on every path
        status, again = rerank(daemon, path, top_n=2)
        assert status == 200 and [r["index"] for r in again["results"]] == [r["index"] for r in results[:2]]
        assert "document" not in again["results"][0]
    child = daemon.engine_for("ranker:latest")
    assert "--rerank" in child.cmdline()


def test_a_model_configured_as_a_reranker_and_the_wrong_models(daemon: Daemon) -> None:
    status, answer = rerank(daemon, model="named-ranker")
    assert status == 200 and len(answer["results"]) == 3, answer
    for model in ("tiny", "embed"):
        status, answer = rerank(daemon, model=model)
        assert status == 400, answer
        assert f'rerank = true under [models."{model}:latest"]' in answer["error"]["message"], answer
    for model in ("named-ranker", "ranker"):  # configured, or a reranker by its GGUF alone
        status, _, data = daemon.request(
            "POST", "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 400 and b"POST /v1/rerank" in data, data
    for bad, param in (
        ({"query": ""}, "query"),
        ({"documents": []}, "documents"),
        ({"documents": [1]}, "documents"),
        ({"top_n": 0}, "top_n"),
        ({"return_documents": "yes"}, "return_documents"),
    ):
        status, answer = rerank(daemon, **bad)
        assert status == 400 and answer["error"]["param"] == param, (bad, answer)
    status, _, data = daemon.request(
        "POST", "/v1/rerank", {"model": "ranker", "query": "q", "documents": ["a"], "rank_fields": ["text"]}
    )
    assert status == 200


def test_the_cohere_sdk_and_plain_http(daemon: Daemon) -> None:
    """
    Cohere's official SDK, v1 (POST /v1/rerank) and v2 (POST /v2/rerank)
    clients, pointed at the gateway; plain httpx, as Jina's API is called.
    """
    import cohere
    import httpx

    base = f"http://127.0.0.1:{daemon.port}"
    v1 = cohere.Client(base_url=base, api_key="none").rerank(
        model="ranker", query="hello", documents=["a b", "hello", "ok"], top_n=2, return_documents=True
    )
    assert len(v1.results) == 2 and v1.results[0].relevance_score >= v1.results[1].relevance_score
    assert v1.results[0].document is not None and v1.results[0].document.text in ("a b", "hello", "ok")
    v2 = cohere.ClientV2(base_url=base, api_key="none").rerank(
        model="ranker", query="hello", documents=["a b", "hello", "ok"], top_n=2, max_tokens_per_doc=100
    )
    assert [r.index for r in v2.results] == [r.index for r in v1.results]
    reply = httpx.post(
        f"{base}/v1/rerank",
        json={"model": "ranker", "query": "hello", "documents": ["a b", "hello"], "top_n": 1},
        timeout=60,
    )
    assert reply.status_code == 200 and len(reply.json()["results"]) == 1


def test_model_lists_say_what_each_model_serves(daemon: Daemon) -> None:
    want = {
        "ranker:latest": "rerank",
        "named-ranker:latest": "rerank",
        "tiny:latest": "chat",
        "embed:latest": "embedding",
    }
    status, _, data = daemon.request("GET", "/v1/models")
    kinds = {m["id"]: m["kind"] for m in json.loads(data)["data"]}
    assert status == 200 and {k: kinds.get(k) for k in want} == want, kinds
    status, _, data = daemon.request("GET", "/v1/models/ranker")
    assert json.loads(data)["kind"] == "rerank"
    status, _, data = daemon.request("GET", "/api/tags")
    kinds = {m["name"]: m["kind"] for m in json.loads(data)["models"]}
    assert {k: kinds.get(k) for k in want} == want, kinds


def test_ollama_style_clients_rerank_on_api_rerank(daemon: Daemon) -> None:
    # the shape of ollama#11389 and langchain's OllamaRerank, answered as /v1/rerank answers, Ollama's errors
    status, answer = daemon.post_json(
        "/api/rerank", {"model": "ranker", "query": "hello", "documents": DOCS, "top_n": 2, "return_documents": True}
    )
    assert status == 200 and len(answer["results"]) == 2, answer
    _, full = rerank(daemon, top_n=2)
    assert [r["index"] for r in answer["results"]] == [r["index"] for r in full["results"]]
    assert all("text" in r["document"] for r in answer["results"])
    status, answer = daemon.post_json("/api/rerank", {"model": "tiny", "query": "hello", "documents": DOCS})
    assert status == 400 and "rerank = true" in answer["error"], answer
    status, answer = daemon.post_json("/api/rerank", {"model": "ranker", "query": "", "documents": DOCS})
    assert status == 400 and "query" in answer["error"], answer


def test_a_rag_stacks_reranker_integration(daemon: Daemon) -> None:
    # langchain's CohereRerank document compressor, pointed at Blazar as a user would
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document
    from pydantic import SecretStr

    reranker = CohereRerank(
        model="ranker", top_n=2, base_url=f"http://127.0.0.1:{daemon.port}", cohere_api_key=SecretStr("none")
    )
    docs = [
        Document(page_content=t, metadata={"n": i})
        for i, t in enumerate(["hello world", "the test model", "yes no ok"])
    ]
    kept = reranker.compress_documents(docs, "hello")
    _, plain = rerank(daemon, top_n=2)
    assert [d.metadata["n"] for d in kept] == [r["index"] for r in plain["results"]]
    scores = [d.metadata["relevance_score"] for d in kept]
    assert scores == sorted(scores, reverse=True) and len(kept) == 2, kept
