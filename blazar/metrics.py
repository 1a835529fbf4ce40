"""
Blazar's Prometheus series, on a registry of its own (never
C{prometheus_client}'s global one), rendered at C{GET /metrics} in the
Prometheus text exposition format (prometheus.io/docs/instrumenting/exposition_formats).

Every series is prefixed C{blazar_}; labels are bounded: C{surface}
(C{openai}, C{ollama}, C{anthropic}), C{model} (a configured or discovered
model's canonical name, C{""} for requests that named none that exists),
C{key} (an API key's name, C{""} without keys), C{status} (C{2xx}, C{4xx},
C{5xx}, C{gone} for a client that left), C{kind} (error kinds, below),
C{priority}, C{class}, C{reason}, C{gpu} (an NVML device index:
L{blazar.engines.hardware.HardwareCensus.collect_metrics},
L{blazar.engines.supervisor.Supervisor.collect_metrics}). Never trace
ids or prompts.

Error kinds (C{blazar_errors_total}): C{auth}, C{forbidden}, C{quota},
C{all_slots_busy}, C{breaker_open}, C{no_capacity}, C{store_unavailable}, C{engine_crash},
C{engine_error}, C{wedge}, C{model_not_found}, or plain C{4xx} / C{5xx}.

Counters and histograms are updated where things happen; gauges that
describe state (queue depth, slots, loaded instances, breakers, engine
hints, dropped audit lines) are read at scrape time from callbacks given
to L{Metrics.gauges}, so they cost nothing between scrapes.
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from blazar import __version__

CONTENT_TYPE = CONTENT_TYPE_LATEST.encode("ascii")
# seconds: a request, a queue wait, a model load
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# seconds per output token: 10 000 tokens/s down to 2 tokens/s
TOKEN_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)


def gauge(name: str, documentation: str, labels: list[str], rows: Iterable[tuple[list[str], float]]) -> Metric:
    """
    A gauge family for a scrape-time collector: C{rows} of (label values,
    value).
    """
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for values, value in rows:
        family.add_metric(values, value)
    return family


class _Callbacks:
    """
    A collector that asks its callbacks for metric families at each scrape.
    """

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], Iterable[Metric]]] = []

    def collect(self) -> Iterable[Metric]:
        for callback in self.callbacks:
            yield from callback()


class Metrics:
    """
    Every series Blazar exports, and its registry.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "blazar_requests",
            "Requests answered, by surface, model, API key and status class",
            ["surface", "model", "key", "status"],
            registry=r,
        )
        self.remote_requests = Counter(
            "blazar_remote_requests",
            "Requests sent to a remote ([[remotes]]), by remote, model, API key and status class",
            ["remote", "model", "key", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "blazar_requests_in_flight",
            "Requests being answered now",
            ["surface"],
            registry=r,
        )
        self.duration = Histogram(
            "blazar_request_duration_seconds",
            "Time from a request's arrival to its last byte",
            ["surface", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "blazar_errors",
            "Requests that failed, by the most specific kind known",
            ["surface", "model", "kind"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "blazar_prompt_tokens",
            "Prompt tokens, as the engine counted them",
            ["model", "key"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "blazar_completion_tokens",
            "Generated tokens, as the engine counted them",
            ["model", "key"],
            registry=r,
        )
        self.audio_seconds = Counter(
            "blazar_audio_seconds",
            "Seconds of audio transcribed or translated (the whisper lane)",
            ["model", "key"],
            registry=r,
        )
        self.images = Counter(
            "blazar_images",
            "Images generated or edited (the sdcpp lane)",
            ["model", "key"],
            registry=r,
        )
        self.ttft = Histogram(
            "blazar_time_to_first_token_seconds",
            "From a request's arrival to the engine's first streamed bytes, measured by Blazar",
            ["surface", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "blazar_time_per_output_token_seconds",
            "Mean time between the engine's streamed chunks, per request, measured by Blazar",
            ["surface", "model"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "blazar_queue_wait_seconds",
            "Time admitted requests waited for a slot",
            ["model", "priority", "class"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.loads = Counter("blazar_loads", "Engine children started", ["model"], registry=r)
        self.load_duration = Histogram(
            "blazar_load_duration_seconds",
            "From spawning an engine child to its /health 200",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.sentinel = Counter(
            "blazar_sentinel",
            "Answers the sentinel flagged (blazar.gateway.sentinel), by code",
            ["model", "code"],
            registry=r,
        )
        self.cache = Counter(
            "blazar_cache",
            "Chat calls the semantic cache was enabled for (blazar.gateway.cache), by result "
            "(hit, miss, bypass: a stream, tools or a response format; error: the prompt could not be embedded)",
            ["model", "result"],
            registry=r,
        )
        self.session_bank = Counter(
            "blazar_session_bank",
            "KV bank slot saves and restores (blazar.gateway.sessions), by result (ok, failed, discarded, other_shape)",
            ["op", "result"],
            registry=r,
        )
        self.evictions = Counter(
            "blazar_evictions",
            "Engine children stopped on purpose, by reason",
            ["model", "reason"],
            registry=r,
        )
        self.crashes = Counter(
            "blazar_engine_crashes",
            "Engine children that exited without being asked",
            ["model"],
            registry=r,
        )
        self.engine_scrape_failures = Counter(
            "blazar_engine_scrape_failures",
            "Failed scrapes of an engine child's /metrics",
            ["model"],
            registry=r,
        )
        self.spans_dropped = Counter(
            "blazar_otlp_spans_dropped",
            "Trace spans dropped (export queue full, or export failed)",
            registry=r,
        )
        Info("blazar_build", "Blazar's version", registry=r).info({"version": __version__})
        self._callbacks = _Callbacks()
        r.register(self._callbacks)

    def gauges(self, callback: Callable[[], Iterable[Metric]]) -> None:
        """
        Add scrape-time gauges: C{callback} returns metric families (see
        L{gauge}); it runs on the reactor thread at each scrape.
        """
        self._callbacks.callbacks.append(callback)

    def render(self) -> bytes:
        """
        The whole registry in the Prometheus text format.
        """
        return bytes(generate_latest(self.registry))


def label_reason(reason: str) -> str:
    """
    A bounded C{reason} label from a stop reason such as C{"making room
    for qwen:7b"} or C{"wedged: no response headers"}.
    """
    return reason.split(":", 1)[0].split(" for ", 1)[0].strip() or "requested"
