"""
The real-model table: decode speed through Blazar against the engine
direct, on a real model (SmolLM2-135M-Instruct, from its PyPI wheel).

    ./dev.sh bench --only realmodel

Blazar's daemon serves it as `smol` (16 slots); its llama-server child is
asked directly (with its per-child key) and through Blazar, alternating,
twice each, the better run of each kept. A run is c concurrent clients
(c = 1, 4, 16), each streaming the same greedy answer (TOKENS tokens, its
end-of-turn ignored) ROUNDS times. Decode tokens/s is every stream's
tokens (the engine's own usage count) over the run's wall time; time to
first token is each stream's first content chunk. The share kept is
Blazar's tokens/s over direct's (target: at least 0.98 at every c).
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from run import Bench

TOKENS = 64
ROUNDS = 2
CONCURRENCY = (1, 4, 16)
KEPT_TARGET = 0.98
ASK = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]


def one_stream(port: int, headers: dict[str, str]) -> tuple[float, int]:
    """
    One streamed answer: seconds to its first content, and its tokens.
    """
    body = {
        "model": "smol",
        "messages": ASK,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    began = time.monotonic()
    first = None
    tokens = 0
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json", **headers})
        response = conn.getresponse()
        assert response.status == 200, response.read()[:300]
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = time.monotonic() - began
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    finally:
        conn.close()
    return (first if first is not None else time.monotonic() - began), tokens


def run(port: int, headers: dict[str, str], c: int) -> dict[str, float]:
    ttfts: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def client() -> None:
        for _ in range(ROUNDS):
            ttft, n = one_stream(port, headers)
            with lock:
                ttfts.append(ttft)
                tokens[0] += n

    began = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - began
    return {
        "tokens_per_s": tokens[0] / seconds,
        "ttft_ms": 1000 * statistics.median(ttfts),
        "tokens": tokens[0],
        "seconds": seconds,
    }


def realmodel_scenario(bench: "Bench") -> None:
    """
    Direct and through Blazar at each concurrency; results into
    C{bench.results["real_model"]}.
    """
    _, engine_port = bench.child("smol")
    direct = {"Authorization": f"Bearer {bench.engine_key}"}
    for port, headers in ((engine_port, direct), (bench.port, {})):
        one_stream(port, headers)  # warm both
    rows = []
    for c in CONCURRENCY:
        runs: dict[str, list[dict[str, float]]] = {"direct": [], "blazar": []}
        for _ in range(2):
            runs["direct"].append(run(engine_port, direct, c))
            runs["blazar"].append(run(bench.port, {}, c))
        best = {t: max(r, key=lambda x: x["tokens_per_s"]) for t, r in runs.items()}
        rows.append(
            {
                "c": c,
                "direct": best["direct"],
                "blazar": best["blazar"],
                "kept": best["blazar"]["tokens_per_s"] / best["direct"]["tokens_per_s"],
                "added_ttft_ms": best["blazar"]["ttft_ms"] - best["direct"]["ttft_ms"],
            }
        )
    from blazar.models.wheels import SMOLLM2

    bench.results["real_model"] = {
        "model": f"{SMOLLM2.name} ({SMOLLM2.package} {SMOLLM2.version}, sha256 {SMOLLM2.sha256[:12]})",
        "tokens_per_stream": TOKENS,
        "streams_per_client": ROUNDS,
        "kept_target": KEPT_TARGET,
        "rows": rows,
        "kept_min": min(r["kept"] for r in rows),
    }


def realmodel_table(r: dict[str, Any]) -> str:
    lines = [
        f"Real model: {r['model']}, {r['tokens_per_stream']}-token greedy streams, "
        f"{r['streams_per_client']} per client",
        f"{'c':>3} {'direct tok/s':>13} {'Blazar tok/s':>13} {'kept':>6} {'TTFT direct':>12} {'TTFT Blazar':>12}",
    ]
    for row in r["rows"]:
        lines.append(
            f"{row['c']:>3} {row['direct']['tokens_per_s']:>13.1f} {row['blazar']['tokens_per_s']:>13.1f} "
            f"{row['kept']:>6.3f} {row['direct']['ttft_ms']:>10.1f}ms {row['blazar']['ttft_ms']:>10.1f}ms"
        )
    verdict = "met" if r["kept_min"] >= r["kept_target"] else "NOT met"
    lines.append(
        f"share of direct's tokens/s kept, lowest: {r['kept_min']:.3f} (target >= {r['kept_target']}: {verdict})"
    )
    return "\n".join(lines)
