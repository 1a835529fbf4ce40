"""
The rerank request and answer (L{blazar.web.translate.rerank}).
"""

from __future__ import annotations

import pytest

from blazar.gateway.errors import BadRequest
from blazar.web.translate.rerank import decode, encode


def test_decode() -> None:
    engine, texts, top_n, docs, ignored = decode(
        {
            "model": "m",
            "query": "q",
            "documents": ["a", {"text": "b"}],
            "top_n": 5,
            "rank_fields": ["text"],
            "keep_alive": 0,
        }
    )
    assert engine == {"query": "q", "documents": ["a", "b"], "top_n": 2}
    assert (texts, top_n, docs, ignored) == (["a", "b"], 2, False, ["rank_fields"])
    assert decode({"query": "q", "documents": ["a"], "top_n": None, "return_documents": True})[2:4] == (1, True)
    for bad, param in (
        ({}, "query"),
        ({"query": "q"}, "documents"),
        ({"query": "q", "documents": [{"t": 1}]}, "documents"),
        ({"query": "q", "documents": ["a"], "top_n": True}, "top_n"),
        ({"query": "q", "documents": ["a"], "return_documents": 1}, "return_documents"),
    ):
        with pytest.raises(BadRequest) as caught:
            decode(bad)
        assert caught.value.param == param


def test_encode_sorts_cuts_and_ties_by_order() -> None:
    answer = {
        "results": [
            {"index": 1, "relevance_score": 0.5},
            {"index": 0, "relevance_score": 0.5},
            {"index": 2, "relevance_score": 0.9},
            {"index": 7, "relevance_score": 1.0},
        ],
        "usage": {"prompt_tokens": 12, "total_tokens": 12},
    }
    out = encode(answer, "m", ["a", "b", "c"], 2, True)
    assert out["results"] == [
        {"index": 2, "relevance_score": 0.9, "document": {"text": "c"}},
        {"index": 0, "relevance_score": 0.5, "document": {"text": "a"}},
    ]
    assert out["usage"] == {"prompt_tokens": 12, "total_tokens": 12} and out["model"] == "m"
    assert out["id"].startswith("rerank-")
