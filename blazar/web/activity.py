"""
What the dashboard (issue 25) shows of recent traffic, kept in memory by
the daemon: the last requests (L{Activity}, bounded; prompts are never
kept) and rolling per-minute aggregates over the last hour
(L{Performance}: requests, generated tokens, latency percentiles), so no
external time-series store is needed. Both are fed once per finished
request by L{blazar.web.observe.RequestObserver}.

Pure: no reactor; times are the caller's clock seconds.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import attrs

RING = 500  # requests kept for the Activity page
MINUTES = 60  # the Performance page's window
SAMPLES_PER_MINUTE = 512  # latencies kept per minute for its percentiles (a reservoir beyond)


@attrs.frozen
class Finished:
    """
    One finished request, as the Activity page lists it.

    @ivar at: When it finished (wall-clock seconds).
    @ivar ms: From its arrival to its last byte.
    @ivar ttft: To the first streamed bytes, seconds, if streamed.
    @ivar tpot: Mean gap between streamed chunks, seconds, if measured.
    """

    at: float
    surface: str
    method: str
    path: str
    model: str
    key: str
    status: str
    code: int
    ms: float
    prompt_tokens: int | None
    completion_tokens: int | None
    ttft: float | None
    tpot: float | None
    trace: str

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


class Activity:
    """
    The last L{RING} finished requests, newest last.
    """

    def __init__(self, size: int = RING) -> None:
        self._ring: deque[Finished] = deque(maxlen=size)

    def add(self, finished: Finished) -> None:
        self._ring.append(finished)

    def recent(
        self,
        limit: int = RING,
        model: str | None = None,
        key: str | None = None,
        status: str | None = None,
        models: set[str] | None = None,
    ) -> list[Finished]:
        """
        The newest C{limit} requests, newest first, filtered.

        @param models: Only these models (a scoped key's view), if given.
        """
        out = []
        for f in reversed(self._ring):
            if (
                model
                and f.model != model
                and not f.model.startswith(model + ":")
                or key
                and f.key != key
                or status
                and f.status != status
            ):
                continue
            if models is not None and f.model not in models:
                continue
            out.append(f)
            if len(out) >= limit:
                break
        return out


@attrs.define
class _Minute:
    start: float
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    seen: int = 0  # latencies offered (the reservoir keeps SAMPLES_PER_MINUTE of them)
    latencies: list[float] = attrs.Factory(list)


class Performance:
    """
    Per-minute aggregates of the last L{MINUTES} minutes: requests,
    errors (5xx), generated tokens, and latency p50/p95 (of a uniform
    sample when a minute has more than L{SAMPLES_PER_MINUTE} requests).
    """

    def __init__(self, minutes: int = MINUTES) -> None:
        self._minutes: deque[_Minute] = deque(maxlen=minutes)
        self._count = 0

    def add(self, at: float, seconds: float, tokens: int, error: bool) -> None:
        start = math.floor(at / 60) * 60
        if not self._minutes or self._minutes[-1].start < start:
            self._minutes.append(_Minute(start))
        minute = self._minutes[-1]
        minute.requests += 1
        minute.errors += error
        minute.tokens += tokens
        minute.seen += 1
        if len(minute.latencies) < SAMPLES_PER_MINUTE:
            minute.latencies.append(seconds)
        else:  # reservoir sampling, deterministic (Knuth's multiplicative hash of the count)
            self._count += 1
            slot = (self._count * 2654435761) % minute.seen
            if slot < SAMPLES_PER_MINUTE:
                minute.latencies[slot] = seconds

    def series(self, now: float) -> list[dict[str, Any]]:
        """
        One point per minute of the last hour that had traffic, oldest
        first: C{minute} (its start, wall-clock seconds), C{requests},
        C{errors}, C{tokens}, C{requests_per_sec}, C{tokens_per_sec},
        C{p50_ms}, C{p95_ms}.
        """
        out = []
        for m in self._minutes:
            if m.start < now - MINUTES * 60:
                continue
            span = max(1.0, min(60.0, now - m.start))  # the current minute so far
            ordered = sorted(m.latencies)
            out.append(
                {
                    "minute": m.start,
                    "requests": m.requests,
                    "errors": m.errors,
                    "tokens": m.tokens,
                    "requests_per_sec": round(m.requests / span, 3),
                    "tokens_per_sec": round(m.tokens / span, 2),
                    "p50_ms": round(_quantile(ordered, 0.50) * 1000, 1),
                    "p95_ms": round(_quantile(ordered, 0.95) * 1000, 1),
                }
            )
        return out


def _quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
