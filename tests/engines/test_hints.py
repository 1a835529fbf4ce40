"""
The engine hints job on a Clock, with a fake fetch: EWMA of the cache hit
ratio and draft acceptance, a child restart, failed and garbage scrapes
that leave the job running (logged once per state change).
"""

from __future__ import annotations

from typing import Any, cast

import attrs
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from blazar.engines.hints import EngineHints, ScrapeError, parse_engine_metrics
from blazar.engines.supervisor import InstanceState
from blazar.metrics import Metrics
from tests.typed import not_none


def page(prompt: float, cached: float, drafted: float = 0, accepted: float = 0, drafts: float = 0) -> bytes:
    return (
        "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed\n"
        "# TYPE llamacpp:prompt_tokens_total counter\n"
        f"llamacpp:prompt_tokens_total {prompt}\n"
        "# TYPE llamacpp:prompt_tokens_cached_total counter\n"
        f"llamacpp:prompt_tokens_cached_total {cached}\n"
        "# TYPE llamacpp:spec_decode_num_draft_tokens_total counter\n"
        f"llamacpp:spec_decode_num_draft_tokens_total {drafted}\n"
        "# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter\n"
        f"llamacpp:spec_decode_num_accepted_tokens_total {accepted}\n"
        "# TYPE llamacpp:spec_decode_num_drafts_total counter\n"
        f"llamacpp:spec_decode_num_drafts_total {drafts}\n"
        "# TYPE llamacpp:requests_processing gauge\n"
        "llamacpp:requests_processing 0\n"
    ).encode()


@attrs.define
class Child:
    name: str
    pid: int = 100
    state: InstanceState = InstanceState.READY
    base_url: str = "http://127.0.0.1:1"

    @property
    def entry(self) -> Any:
        return attrs.make_class("Entry", ["name"])(self.name)

    @property
    def auth_headers(self) -> dict[bytes, list[bytes]]:
        return {b"authorization": [b"Bearer k"]}


class HintsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.metrics = Metrics()
        self.children = [Child("m:latest")]
        self.answers: list[Any] = []
        self.fetched: list[tuple[str, dict[bytes, list[bytes]]]] = []

        async def fetch(url: str, headers: dict[bytes, list[bytes]]) -> tuple[int, bytes]:
            self.fetched.append((url, headers))
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

        self.hints = EngineHints(lambda: self.children, fetch, self.clock, self.metrics)
        self.hints.startService()
        self.addCleanup(self.hints.stopService)
        self.warnings: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            if event.get("log_level") in (LogLevel.warn, LogLevel.error, LogLevel.critical):
                self.warnings.append(event.get("log_format", ""))

        globalLogPublisher.addObserver(cast(ILogObserver, observe))
        self.addCleanup(globalLogPublisher.removeObserver, cast(ILogObserver, observe))

    def tick(self, *answers: Any) -> None:
        self.answers.extend(answers)
        self.clock.advance(60)

    def gauge(self, name: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, {"model": "m:latest"})

    def test_ewma_of_cache_hits(self) -> None:
        self.tick((200, page(prompt=80, cached=20)))
        self.assertEqual(self.fetched[0][0], "http://127.0.0.1:1/metrics")
        self.assertEqual(self.fetched[0][1][b"authorization"], [b"Bearer k"])
        self.assertAlmostEqual(self.gauge("blazar_engine_cache_hit_ratio"), 0.2)
        # the next minute: 10 evaluated, 90 cached -> 0.9; EWMA 0.7 * 0.2 + 0.3 * 0.9
        self.tick((200, page(prompt=90, cached=110)))
        self.assertAlmostEqual(self.gauge("blazar_engine_cache_hit_ratio"), 0.41)
        self.assertEqual(self.gauge("blazar_engine_prompt_tokens_cached_total"), 110)
        self.assertEqual(
            not_none(self.hints.for_model("m:latest")).cache_hit, self.gauge("blazar_engine_cache_hit_ratio")
        )
        # nothing drafted yet: no acceptance figure
        self.assertIsNone(self.gauge("blazar_engine_draft_acceptance_ratio"))

    def test_draft_acceptance(self) -> None:
        self.tick((200, page(prompt=10, cached=0, drafted=100, accepted=50)))
        self.tick((200, page(prompt=10, cached=0, drafted=200, accepted=150)))
        self.assertAlmostEqual(self.gauge("blazar_engine_draft_acceptance_ratio"), 0.7 * 0.5 + 0.3 * 1.0)

    def test_accepted_tokens_per_draft(self) -> None:
        """
        The EWMA of accepted tokens per draft, per interval: 40 drafts
        that got 184 of 320 tokens accepted (a real ngram-cache run's
        counters), then 10 more drafts with 20 more accepted.
        """
        self.tick((200, page(prompt=10, cached=0)))
        self.assertIsNone(self.gauge("blazar_engine_accepted_per_draft"))
        self.tick((200, page(prompt=10, cached=0, drafted=320, accepted=184, drafts=40)))
        self.assertAlmostEqual(self.gauge("blazar_engine_accepted_per_draft"), 4.6)
        self.tick((200, page(prompt=10, cached=0, drafted=400, accepted=204, drafts=50)))
        self.assertAlmostEqual(self.gauge("blazar_engine_accepted_per_draft"), 0.7 * 4.6 + 0.3 * 2.0)
        hint = not_none(self.hints.for_model("m:latest"))
        self.assertAlmostEqual(not_none(hint.accepted_per_draft), 0.7 * 4.6 + 0.3 * 2.0)
        self.assertAlmostEqual(not_none(hint.draft_acceptance), 0.7 * (184 / 320) + 0.3 * (20 / 80))
        # nothing drafted in an interval: the averages stay
        self.tick((200, page(prompt=20, cached=0, drafted=400, accepted=204, drafts=50)))
        self.assertAlmostEqual(self.gauge("blazar_engine_accepted_per_draft"), 0.7 * 4.6 + 0.3 * 2.0)

    def test_a_new_child_restarts_counters_not_averages(self) -> None:
        self.tick((200, page(prompt=50, cached=50)))
        self.children[0].pid = 200
        # the new child's counters start from zero: 10 of 20 cached
        self.tick((200, page(prompt=10, cached=10)))
        self.assertAlmostEqual(self.gauge("blazar_engine_cache_hit_ratio"), 0.5)

    def test_a_new_child_starts_its_draft_figures_afresh(self) -> None:
        """
        A new child's drafting is its own: after an idle reload that took
        n-gram lookup off (C{speculative = "auto"}), the acceptance of the
        child before is no longer shown as the model's.
        """
        self.tick((200, page(prompt=10, cached=0, drafted=100, accepted=80, drafts=10)))
        self.assertAlmostEqual(self.gauge("blazar_engine_draft_acceptance_ratio"), 0.8)
        self.children[0].pid = 200
        self.tick((200, page(prompt=10, cached=0)))
        self.assertIsNone(self.gauge("blazar_engine_draft_acceptance_ratio"))
        self.assertIsNone(self.gauge("blazar_engine_accepted_per_draft"))

    def test_a_labelled_series_is_not_one_number(self) -> None:
        text = page(1, 2).decode() + (
            "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter\n"
            'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 38\n'
            'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 20\n'
        )
        self.assertNotIn("llamacpp:spec_decode_num_accepted_tokens_per_pos_total", parse_engine_metrics(text))

    def test_failures_and_garbage_leave_the_job_running(self) -> None:
        self.tick(ConnectionRefusedError("refused"))
        self.tick((200, b"<html>not metrics</html>\x00{{{"))
        self.tick((503, b"loading"))
        self.assertEqual(
            self.metrics.registry.get_sample_value("blazar_engine_scrape_failures_total", {"model": "m:latest"}), 3
        )
        # logged once for the change to failing, not once per failure
        self.assertEqual(len([w for w in self.warnings if "engine /metrics" in w]), 1)
        self.tick((200, page(prompt=1, cached=3)))
        self.assertAlmostEqual(self.gauge("blazar_engine_cache_hit_ratio"), 0.75)
        self.tick(ValueError("boom"))
        self.assertEqual(len([w for w in self.warnings if "engine /metrics" in w]), 2)

    def test_children_not_ready_are_skipped(self) -> None:
        self.children[0].state = InstanceState.STARTING
        self.tick()
        self.assertEqual(self.fetched, [])

    def test_parse(self) -> None:
        self.assertEqual(parse_engine_metrics(page(1, 2).decode())["llamacpp:prompt_tokens_cached_total"], 2)
        with self.assertRaises(ScrapeError):
            parse_engine_metrics("something_else 1\n")

    def test_exposition_parses(self) -> None:
        self.tick((200, page(prompt=80, cached=20)))
        names = {f.name for f in text_string_to_metric_families(self.metrics.render().decode())}
        self.assertIn("blazar_engine_cache_hit_ratio", names)
        self.assertIn("blazar_build_info", names)
