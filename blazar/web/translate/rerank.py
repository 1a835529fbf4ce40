"""
Reranking (issue 23): the request Jina, Cohere and llama.cpp clients send
to C{POST /v1/rerank} (also C{/rerank} and C{/v1/reranking}), checked and
turned into llama-server's C{/v1/rerank} body; its answer into theirs.

Request: C{model}, C{query}, C{documents} (strings, or objects with
C{text}), C{top_n}, C{return_documents}. Answer: C{results} (C{index},
C{relevance_score}, sorted best first; C{document} C{{text}} when asked),
C{usage}, C{model}, and Cohere's C{id} and C{meta}.

Pure: no reactor, no I/O.
"""

from __future__ import annotations

import secrets
from typing import Any

from blazar.gateway.errors import BadRequest

# the rest (Cohere's max_chunks_per_doc, rank_fields, max_tokens_per_doc,
# priority, ...) is accepted and named in x-blazar-ignored
KNOWN = ("model", "query", "documents", "top_n", "return_documents")


def decode(body: dict[str, Any]) -> tuple[dict[str, Any], list[str], int, bool, list[str]]:
    """
    The engine's body, the documents' texts, C{top_n}, whether to return
    the documents, and the fields ignored.

    @raise BadRequest: A missing or malformed field (named).
    """
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise BadRequest("query: a non-empty string is required", "query")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise BadRequest(
            'documents: a non-empty array of strings (or of {"text": ...} objects) is required', "documents"
        )
    texts = []
    for i, document in enumerate(documents):
        if isinstance(document, dict):
            document = document.get("text")
        if not isinstance(document, str):
            raise BadRequest(f'documents[{i}]: a string, or an object with a string "text"', "documents")
        texts.append(document)
    top_n = body.get("top_n", len(texts))
    if top_n is None:
        top_n = len(texts)
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise BadRequest("top_n: a positive integer", "top_n")
    return_documents = body.get("return_documents", False)
    if return_documents is None:
        return_documents = False
    if not isinstance(return_documents, bool):
        raise BadRequest("return_documents: true or false", "return_documents")
    ignored = [k for k in body if k not in KNOWN and k != "keep_alive"]
    return (
        {"query": query, "documents": texts, "top_n": len(texts)},
        texts,
        min(top_n, len(texts)),
        return_documents,
        ignored,
    )


def encode(
    answer: dict[str, Any],
    model: str,
    texts: list[str],
    top_n: int,
    return_documents: bool,
) -> dict[str, Any]:
    """
    The client's answer from llama-server's.
    """
    results = []
    for item in answer.get("results") or []:
        if not isinstance(item, dict) or not isinstance(item.get("index"), int):
            continue
        index = item["index"]
        if not 0 <= index < len(texts):
            continue
        result: dict[str, Any] = {"index": index, "relevance_score": float(item.get("relevance_score") or 0.0)}
        if return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    # best first; ties by the documents' order, so a repeat orders alike
    results.sort(key=lambda r: (-r["relevance_score"], r["index"]))
    usage = answer.get("usage") or {}
    prompt = int(usage.get("prompt_tokens") or usage.get("total_tokens") or 0)
    return {
        "id": f"rerank-{secrets.token_hex(12)}",
        "object": "list",
        "model": model,
        "results": results[:top_n],
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
        "meta": {"billed_units": {"search_units": 1}},
    }
