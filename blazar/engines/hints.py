"""
The engine hints job: every minute, read each ready child's own
C{/metrics} (llama-server's Prometheus counters, served with C{--metrics})
and keep per model what they say about the work: the prompt cache hit
ratio and the speculative-decoding draft acceptance and accepted tokens per
draft, as EWMAs (0.7 old, 0.3 new), plus the latest raw counters.

Counters read (llama.cpp C{tools/server}, names as this build serves them):
C{llamacpp:prompt_tokens_total} (prompt tokens evaluated, cached ones
excluded), C{llamacpp:prompt_tokens_cached_total},
C{llamacpp:spec_decode_num_draft_tokens_total},
C{llamacpp:spec_decode_num_accepted_tokens_total} and
C{llamacpp:spec_decode_num_drafts_total} (docs/speculative.md). Per
interval, cache hit = cached / (cached + evaluated), draft acceptance =
accepted / drafted tokens and accepted per draft = accepted tokens /
drafts (both skipped while nothing was drafted).

A scrape that fails (no answer, an error status, not the Prometheus text
format) is counted and logged once when a model's scrape state changes;
it never stops the job.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Iterable

import attrs
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from zope.interface import Interface, implementer

from blazar.engines.instance import InstanceState
from blazar.metrics import Metrics, gauge

log = Logger()

INTERVAL = 60.0
EWMA_OLD = 0.7
PROMPT = "llamacpp:prompt_tokens_total"
CACHED = "llamacpp:prompt_tokens_cached_total"
DRAFTED = "llamacpp:spec_decode_num_draft_tokens_total"
ACCEPTED = "llamacpp:spec_decode_num_accepted_tokens_total"
DRAFTS = "llamacpp:spec_decode_num_drafts_total"


class ScrapeError(Exception):
    """
    A child's C{/metrics} could not be read or parsed.
    """


def parse_engine_metrics(text: str) -> dict[str, float]:
    """
    The C{llamacpp:*} samples of a Prometheus text page, by sample name.

    @raise ScrapeError: Not the text format, or no llama.cpp counters.
    """
    try:
        samples = {
            sample.name: float(sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name.startswith("llamacpp:") and not sample.labels
            # (a labelled series, as the accepted tokens per draft position, is not one number)
        }
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise ScrapeError(f"not the Prometheus text format: {e}") from None
    if PROMPT not in samples:
        raise ScrapeError(f"no {PROMPT} in the engine's /metrics")
    return samples


def ewma(old: float | None, new: float) -> float:
    return new if old is None else EWMA_OLD * old + (1 - EWMA_OLD) * new


@attrs.define
class EngineHint:
    """
    What one model's child reported lately.

    @ivar counters: The latest C{llamacpp:*} samples.
    @ivar cache_hit: EWMA of the prompt cache hit ratio (0-1), or L{None}.
    @ivar draft_acceptance: EWMA of accepted / drafted tokens, or L{None}.
    @ivar accepted_per_draft: EWMA of the tokens accepted per draft (0 to
        the most a draft holds), or L{None}.
    @ivar pid: The child the counters came from (a new child restarts
        the counters, not the averages).
    """

    counters: dict[str, float] = attrs.field(factory=dict)
    cache_hit: float | None = None
    draft_acceptance: float | None = None
    accepted_per_draft: float | None = None
    pid: int | None = None
    failing: bool = False

    def update(self, pid: int | None, counters: dict[str, float]) -> None:
        previous = self.counters if pid == self.pid else {}
        if pid != self.pid:
            # a new child (a reload, auto turning lookup off): its drafting is its own, from nothing
            self.draft_acceptance = self.accepted_per_draft = None

        def delta(name: str) -> float:
            return max(0.0, counters.get(name, 0.0) - previous.get(name, 0.0))

        evaluated, cached = delta(PROMPT), delta(CACHED)
        if evaluated + cached > 0:
            self.cache_hit = ewma(self.cache_hit, cached / (evaluated + cached))
        drafted = delta(DRAFTED)
        if drafted > 0:
            self.draft_acceptance = ewma(self.draft_acceptance, min(1.0, delta(ACCEPTED) / drafted))
        drafts = delta(DRAFTS)
        if drafts > 0:
            self.accepted_per_draft = ewma(self.accepted_per_draft, delta(ACCEPTED) / drafts)
        self.counters = counters
        self.pid = pid


class IEngineHints(Interface):
    """
    What the engines said about themselves lately, per model: what
    C{blazar ps} and the dashboard show beside each instance.
    """

    def for_model(name: str) -> EngineHint | None:
        """
        The latest hint for canonical model C{name}, if any.
        """


@implementer(IEngineHints)
class EngineHints(Service):
    """
    The job (a L{LoopingCall} every L{INTERVAL} seconds on C{clock}).

    @param instances: The supervisor's live instances (objects with
        C{state}, C{pid}, C{base_url}, C{auth_headers}, C{entry.name}).
    @param fetch: GETs a URL with headers: C{(status, body)}.
    """

    def __init__(
        self,
        instances: Callable[[], list[Any]],
        fetch: Callable[[str, dict[bytes, list[bytes]]], Awaitable[tuple[int, bytes]]],
        clock: Any,
        metrics: Metrics,
        interval: float = INTERVAL,
    ) -> None:
        self._instances = instances
        self._fetch = fetch
        self._clock = clock
        self._metrics = metrics
        self._interval = interval
        self.hints: dict[str, EngineHint] = {}
        self._job: LoopingCall | None = None
        metrics.gauges(self.collect_metrics)

    def startService(self) -> None:
        Service.startService(self)
        self._job = LoopingCall(lambda: Deferred.fromCoroutine(self.scrape()))
        self._job.clock = self._clock
        self._job.start(self._interval, now=False).addErrback(lambda f: log.failure("engine hints job stopped", f))

    def stopService(self) -> None:
        Service.stopService(self)
        if self._job is not None and self._job.running:
            self._job.stop()

    async def scrape(self) -> None:
        """
        One round: every ready child, one after the other. Never raises.
        """
        for instance in self._instances():
            if instance.state != InstanceState.READY or getattr(instance, "lane", "llamacpp") != "llamacpp":
                continue  # (a command lane's server has no llama-server /metrics)
            name = instance.entry.name
            hint = self.hints.setdefault(name, EngineHint())
            try:
                counters = await self._scrape_one(instance)
            except Exception as e:
                self._metrics.engine_scrape_failures.labels(name).inc()
                if not hint.failing:
                    hint.failing = True
                    log.warn("cannot read {model}'s engine /metrics: {error}", model=name, error=str(e) or repr(e))
                continue
            if hint.failing:
                hint.failing = False
                log.info("reading {model}'s engine /metrics works again", model=name)
            hint.update(instance.pid, counters)

    async def _scrape_one(self, instance: Any) -> dict[str, float]:
        status, body = await self._fetch(instance.base_url + "/metrics", instance.auth_headers)
        if status != 200:
            raise ScrapeError(f"the engine answered /metrics with {status}")
        return parse_engine_metrics(body.decode("utf-8", "replace"))

    def for_model(self, name: str) -> EngineHint | None:
        return self.hints.get(name)

    def collect_metrics(self) -> Iterable[Metric]:
        """
        Scrape-time gauges: C{blazar_engine_cache_hit_ratio},
        C{blazar_engine_draft_acceptance_ratio},
        C{blazar_engine_accepted_per_draft} and every C{llamacpp:*}
        counter as C{blazar_engine_<name>}, by model.
        """
        hints = sorted(self.hints.items())
        yield gauge(
            "blazar_engine_cache_hit_ratio",
            "EWMA of the engine's prompt cache hit ratio",
            ["model"],
            [([n], h.cache_hit) for n, h in hints if h.cache_hit is not None],
        )
        yield gauge(
            "blazar_engine_draft_acceptance_ratio",
            "EWMA of the engine's accepted / drafted speculative tokens",
            ["model"],
            [([n], h.draft_acceptance) for n, h in hints if h.draft_acceptance is not None],
        )
        yield gauge(
            "blazar_engine_accepted_per_draft",
            "EWMA of the speculative tokens the engine accepted per draft",
            ["model"],
            [([n], h.accepted_per_draft) for n, h in hints if h.accepted_per_draft is not None],
        )
        names = sorted({k for _, h in hints for k in h.counters})
        for counter in names:
            yield gauge(
                "blazar_engine_" + counter.split(":", 1)[1],
                f"The engine's own {counter}, as last scraped",
                ["model"],
                [([n], h.counters[counter]) for n, h in hints if counter in h.counters],
            )
