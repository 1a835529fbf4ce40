"""
The dashboard's in-memory traffic views (blazar.web.activity): a bounded
ring of finished requests, and per-minute aggregates of the last hour.
"""

from __future__ import annotations

from blazar.web.activity import SAMPLES_PER_MINUTE, Activity, Finished, Performance


def finished(n: int, model: str = "m", key: str = "k", status: str = "2xx") -> Finished:
    return Finished(
        at=float(n),
        surface="openai",
        method="POST",
        path="/v1/chat/completions",
        model=model,
        key=key,
        status=status,
        code=200,
        ms=1.0,
        prompt_tokens=1,
        completion_tokens=2,
        ttft=None,
        tpot=None,
        trace=f"t{n}",
    )


def test_the_ring_keeps_the_newest_and_filters() -> None:
    ring = Activity(size=3)
    for n in range(5):
        ring.add(finished(n, model="a" if n % 2 else "b", key="x" if n < 3 else "y"))
    assert [f.trace for f in ring.recent()] == ["t4", "t3", "t2"]  # newest first, bounded
    assert [f.trace for f in ring.recent(model="a")] == ["t3"]
    assert [f.trace for f in ring.recent(key="x")] == ["t2"]
    assert [f.trace for f in ring.recent(models={"b"})] == ["t4", "t2"]
    assert [f.trace for f in ring.recent(limit=1)] == ["t4"]
    assert ring.recent()[0].to_json()["path"] == "/v1/chat/completions"


def test_per_minute_rates_and_percentiles() -> None:
    perf = Performance()
    for i in range(100):  # minute 0: 100 requests, latencies 1..100 ms, 10 tokens each, 5 errors
        perf.add(10.0 + i * 0.5, (i + 1) / 1000, 10, i < 5)
    perf.add(70.0, 0.2, 0, False)  # minute 1
    series = perf.series(now=90.0)
    first, second = series
    assert (first["minute"], first["requests"], first["errors"], first["tokens"]) == (0, 100, 5, 1000)
    assert (first["requests_per_sec"], first["tokens_per_sec"]) == (round(100 / 60, 3), round(1000 / 60, 2))
    assert (first["p50_ms"], first["p95_ms"]) == (51.0, 96.0)
    assert second["requests"] == 1 and second["requests_per_sec"] == round(1 / 30, 3)  # 30 s into it
    assert perf.series(now=60.0 * 61) == [
        {**second, "requests_per_sec": round(1 / 60, 3), "tokens_per_sec": 0.0}
    ]  # the hour's window moved on


def test_a_busy_minute_keeps_a_bounded_sample() -> None:
    perf = Performance()
    for i in range(SAMPLES_PER_MINUTE * 4):
        perf.add(1.0, 1.0 if i % 2 else 3.0, 1, False)
    (minute,) = perf.series(now=30.0)
    assert minute["requests"] == SAMPLES_PER_MINUTE * 4
    assert minute["p50_ms"] in (1000.0, 3000.0) and minute["p95_ms"] == 3000.0
    assert len(perf._minutes[-1].latencies) == SAMPLES_PER_MINUTE
