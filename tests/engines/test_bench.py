"""
C{blazar bench}'s measurement (L{blazar.engines.bench}): what a stream's
chunks say, the rates and percentiles, a level's summary, the driver
against an in-memory gateway, the comparison of two runs and the engine
gate's speed margin.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Callable, Iterator, cast

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from blazar.engines import bench
from blazar.engines.bench import Level, Sample, StreamRecorder
from blazar.engines.gate import _Child
from tests.typed import StubTreq


def chunk(**fields: Any) -> bytes:
    return b"data: " + json.dumps({"object": "chat.completion.chunk", **fields}).encode() + b"\n\n"


def text(content: str) -> bytes:
    return chunk(choices=[{"index": 0, "delta": {"content": content}, "finish_reason": None}])


USAGE = chunk(
    choices=[],
    usage={"prompt_tokens": 100, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 20}},
    timings={"prompt_per_second": 900.5, "predicted_per_second": 55.25},
)


def scripted(times: list[float]) -> Callable[[], float]:
    it: Iterator[float] = iter(times)
    return lambda: next(it)


class StreamRecorderTests(SynchronousTestCase):
    def test_first_and_last_text_usage_and_timings(self) -> None:
        # one reading of the clock per event: role chunk, 5 texts, the finish, the usage
        recorder = StreamRecorder(scripted([1.0, 1.5, 1.6, 1.7, 1.8, 1.9, 1.95, 2.0]))
        role = chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": None}}])
        stream = (
            role
            + b"".join(text(t) for t in "abcde")
            + chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "length"}])
            + USAGE
            + b"data: [DONE]\n\n"
        )
        for i in range(0, len(stream), 7):  # split anywhere
            recorder.feed(stream[i : i + 7])
        sample = recorder.sample(sent=0.5, done=2.1)
        self.assertEqual((sample.first, sample.last), (1.5, 1.9))
        self.assertEqual((sample.prompt_tokens, sample.cached_tokens, sample.completion_tokens), (100, 20, 5))
        self.assertEqual((sample.engine_pp_tps, sample.engine_gen_tps), (900.5, 55.25))
        self.assertIsNone(sample.error)
        self.assertAlmostEqual(sample.ttft, 1.0)
        self.assertAlmostEqual(sample.pp_tps, 80.0)  # (100 - 20 cached) / 1 s
        self.assertAlmostEqual(sample.gen_tps, 10.0)  # 4 tokens after the first in 0.4 s

    def test_reasoning_and_tool_call_fragments_are_generated_tokens(self) -> None:
        recorder = StreamRecorder(scripted([1.0, 2.0]))
        recorder.feed(chunk(choices=[{"index": 0, "delta": {"reasoning_content": "hm"}}]))
        recorder.feed(
            chunk(choices=[{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}])
        )
        sample = recorder.sample(0.0, 2.5)
        self.assertEqual((sample.first, sample.last, sample.completion_tokens), (1.0, 2.0, 2))  # counted: no usage

    def test_an_error_event_or_no_text_is_a_failed_sample(self) -> None:
        recorder = StreamRecorder(scripted([1.0]))
        recorder.feed(chunk(error={"message": "the engine crashed"}))
        self.assertEqual(recorder.sample(0.0, 1.0).error, "the engine crashed")
        self.assertEqual(StreamRecorder(scripted([])).sample(0.0, 1.0).error, "the stream carried no generated text")

    def test_tokens_with_no_text_yet_are_generated(self) -> None:
        # a random-weight model's few tokens may all be the first bytes of characters (held back
        # until whole) or special tokens: the usage says they were generated, so not a failure
        recorder = StreamRecorder(scripted([1.0]))
        recorder.feed(chunk(choices=[], usage={"prompt_tokens": 10, "completion_tokens": 4}))
        sample = recorder.sample(0.0, 1.5)
        self.assertIsNone(sample.error)
        self.assertEqual((sample.first, sample.last, sample.completion_tokens), (1.5, 1.5, 4))
        recorder = StreamRecorder(scripted([1.0]))
        recorder.feed(chunk(choices=[], usage={"prompt_tokens": 10, "completion_tokens": 0}))
        self.assertEqual(recorder.sample(0.0, 1.5).error, "the stream carried no generated text")

    def test_bad_numbers_are_not_rates(self) -> None:
        recorder = StreamRecorder(scripted([1.0, 1.1]))
        recorder.feed(
            text("a")
            + chunk(
                choices=[],
                usage={"prompt_tokens": True, "completion_tokens": -3},
                timings={"prompt_per_second": 0, "predicted_per_second": "fast"},
            )
        )
        sample = recorder.sample(0.0, 1.2)
        self.assertEqual((sample.prompt_tokens, sample.completion_tokens), (None, 1))
        self.assertEqual((sample.engine_pp_tps, sample.engine_gen_tps), (None, None))
        self.assertIsNone(sample.pp_tps)
        self.assertIsNone(sample.gen_tps)  # one token: no rate after the first


class MathTests(SynchronousTestCase):
    def test_percentile_interpolates_between_ranks(self) -> None:
        self.assertIsNone(bench.percentile([], 50))
        self.assertEqual(bench.percentile([7.0], 90), 7.0)
        self.assertEqual(bench.percentile([4.0, 1.0, 3.0, 2.0], 50), 2.5)
        self.assertAlmostEqual(bench.percentile([10.0, 20.0, 30.0, 40.0, 50.0], 90), 46.0)
        self.assertEqual(bench.percentile([1.0, 2.0], 100), 2.0)

    def test_a_level_summarises_its_requests(self) -> None:
        samples = [
            Sample(sent=0.0, first=0.1, last=1.1, done=1.2, prompt_tokens=50, completion_tokens=11),  # 10 tok/s
            Sample(
                sent=0.0,
                first=0.3,
                last=0.8,
                done=0.9,
                prompt_tokens=60,
                cached_tokens=10,
                completion_tokens=11,
                engine_gen_tps=25.0,
            ),  # 20 tok/s
            Sample(sent=0.0, error="HTTP 503: busy"),
        ]
        level = bench.summarise(2, samples, wall=2.0)
        self.assertEqual((level.concurrency, level.requests, level.errors), (2, 3, 1))
        self.assertEqual((level.prompt_tokens, level.completion_tokens), (55, 22))
        self.assertEqual((level.ttft_ms, level.ttft_ms_p90), (200.0, 280.0))
        self.assertEqual(level.gen_tps, 15.0)  # the median of 10 and 20
        self.assertEqual(level.pp_tps, 333.3)  # the median of 50/0.1 = 500 and 50/0.3 = 166.7
        self.assertEqual(level.gen_tps_total, 11.0)  # 22 tokens in 2 s
        self.assertEqual((level.engine_gen_tps, level.engine_pp_tps), (25.0, None))
        self.assertEqual(Level(**level.to_json()), level)

    def test_a_level_with_only_failures_has_no_figures(self) -> None:
        level = bench.summarise(1, [Sample(sent=0.0, error="x")], wall=1.0)
        self.assertEqual((level.errors, level.ttft_ms, level.gen_tps, level.gen_tps_total), (1, None, None, None))

    def test_each_prompt_starts_with_its_own_salt(self) -> None:
        a, b = bench.synthetic_prompt(50, "s1"), bench.synthetic_prompt(50, "s2")
        self.assertTrue(a.startswith("s1: ") and b.startswith("s2: "))
        self.assertEqual(a[2:], b[2:])  # the same text after the salt: runs measure the same work
        self.assertEqual(len(a.split(": ", 2)[-1].split()), 50)
        body = bench.request_body("m", a, 16)
        self.assertEqual(
            (body["stream"], body["stream_options"], body["max_tokens"], body["ignore_eos"]),
            (True, {"include_usage": True}, 16, True),
        )


def level_json(concurrency: int, **figures: Any) -> dict[str, Any]:
    base = bench.summarise(concurrency, [], 1.0).to_json()
    return {**base, "requests": 2, **figures}


def run(
    id_: int,
    engine: str = "llamacpp@a",
    argv: tuple[str, ...] = ("/bin/llama-server", "-ngl", "5"),
    levels: list[dict[str, Any]] | None = None,
    **settings: Any,
) -> dict[str, Any]:
    return {
        "id": id_,
        "model": "m:latest",
        "created": 1.0,
        "engine": engine,
        "profile": {"argv": list(argv)},
        "hardware": {"cpu_physical_cores": 2},
        "settings": {"prompt_tokens": 512, "max_tokens": 128, "rounds": 2, **settings},
        "levels": levels or [level_json(1, gen_tps=100.0, ttft_ms=50.0)],
    }


class CompareTests(SynchronousTestCase):
    def test_delta_percent(self) -> None:
        self.assertEqual(bench.delta_percent(100.0, 110.0), 10.0)
        self.assertEqual(bench.delta_percent(80.0, 60.0), -25.0)
        self.assertIsNone(bench.delta_percent(0.0, 1.0))
        self.assertIsNone(bench.delta_percent(None, 1.0))

    def test_levels_both_runs_measured_are_compared(self) -> None:
        before = run(1, levels=[level_json(1, gen_tps=100.0, ttft_ms=50.0), level_json(2, gen_tps=90.0)])
        after = run(2, levels=[level_json(1, gen_tps=120.0, ttft_ms=40.0), level_json(4, gen_tps=70.0)])
        result = bench.compare(before, after)
        self.assertEqual((result["before"], result["after"], result["changes"]), (1, 2, []))
        (level,) = result["levels"]
        self.assertEqual(level["concurrency"], 1)
        self.assertEqual(level["gen_tps"], {"before": 100.0, "after": 120.0, "delta_percent": 20.0})
        self.assertEqual(level["ttft_ms"]["delta_percent"], -20.0)
        self.assertEqual(level["pp_tps"]["delta_percent"], None)
        lines = bench.comparison_lines(result)
        self.assertEqual(lines[:2], ["run 2 against run 1:", "  same engine, profile, hardware and settings"])
        self.assertIn("100.0 -> 120.0 (+20.0 %)", lines[-1])
        self.assertIn("50 ms -> 40 ms (-20.0 %)", lines[-1])

    def test_what_changed_between_runs_is_named(self) -> None:
        before = run(1)
        after = run(2, engine="llamacpp@b", argv=("/other/llama-server", "-ngl", "99", "-fa", "on"), max_tokens=64)
        after["hardware"] = {"cpu_physical_cores": 16}
        self.assertEqual(
            bench.changes(before, after),
            [
                "engine: llamacpp@a -> llamacpp@b",
                "profile: -fa (unset) -> on",
                "profile: -ngl 5 -> 99",
                "hardware: changed",
                "settings: max_tokens 128 -> 64",
            ],
        )

    def test_flags_read_values_and_switches(self) -> None:
        self.assertEqual(
            bench.flags(
                ["bin", "-m", "/x.gguf", "--jinja", "-ngl", "-1", "--threads", "4", "--threads", "8", "--no-webui"]
            ),
            {"-m": "/x.gguf", "--jinja": "", "-ngl": "-1", "--threads": "8", "--no-webui": ""},
        )


class CheckRunTests(SynchronousTestCase):
    def good(self) -> dict[str, Any]:
        return {
            "settings": {
                "prompt_tokens": 8,
                "max_tokens": 4,
                "rounds": 1,
                "concurrency": [1],
                "url": "u",
                "extra": "dropped",
            },
            "levels": [level_json(1, gen_tps=5.0)],
        }

    def test_a_run_is_checked_and_trimmed(self) -> None:
        checked = bench.check_run(self.good())
        self.assertEqual(
            checked["settings"], {"prompt_tokens": 8, "max_tokens": 4, "rounds": 1, "concurrency": [1], "url": "u"}
        )

    def test_malformed_runs_are_refused(self) -> None:
        for change in (
            lambda r: r.update(levels=[]),
            lambda r: r["levels"][0].update(gen_tps=float("nan")),
            lambda r: r["levels"][0].update(gen_tps=-1),
            lambda r: r["levels"][0].update(extra=1),
            lambda r: r["levels"][0].update(concurrency=0),
            lambda r: r["settings"].update(rounds="2"),
            lambda r: r["settings"].update(concurrency="1,2"),
            lambda r: r.pop("settings"),
        ):
            bad = self.good()
            change(bad)
            with self.assertRaises(ValueError):
                bench.check_run(bad)


class SpeedMarginTests(SynchronousTestCase):
    def test_slowdown_within_the_margin_passes(self) -> None:
        self.assertAlmostEqual(bench.slowdown(100.0, 80.0), 0.2)
        self.assertIsNone(bench.speed_refusal(100.0, 91.0, 0.10))
        self.assertIsNone(bench.speed_refusal(100.0, 150.0, 0.10))  # faster
        self.assertIsNone(bench.speed_refusal(100.0, 1.0, 0.0))  # 0: no speed check

    def test_a_slower_candidate_is_refused_naming_the_key(self) -> None:
        refusal = bench.speed_refusal(100.0, 80.0, 0.10)
        assert refusal is not None
        self.assertIn("80.0 tokens/s", refusal)
        self.assertIn("100.0", refusal)
        self.assertIn("20.0 % slower", refusal)
        self.assertIn("[engines] gate_max_slowdown = 0.1 allows 10 %", refusal)

    def test_the_gate_takes_each_engines_best_in_turns(self) -> None:
        from blazar.engines.gate import thd_compare_speed

        calls: list[str] = []

        class Child:
            def __init__(self, name: str, rates: list[float]) -> None:
                self.name, self.rates = name, iter(rates)

            def decode_speed(self, tokens: int = 64) -> float:
                calls.append(f"{self.name}{tokens}")
                return next(self.rates)

        candidate = Child("c", [1.0, 50.0, 70.0, 60.0])
        active = Child("a", [1.0, 90.0, 80.0, 100.0])
        self.assertEqual(thd_compare_speed(cast(_Child, candidate), cast(_Child, active), rounds=3), (70.0, 100.0))
        self.assertEqual(calls, ["c4", "a4", "c64", "a64", "c64", "a64", "c64", "a64"])  # warm-ups, then turns


def gateway_app(status: int = 200, busy_after: int | None = None) -> Any:
    """
    A gateway's chat completions in memory, recording each prompt in
    C{app.prompts}: every answer C{status}, or 503 once C{busy_after}
    requests were answered.
    """
    from klein import Klein

    app: Any = Klein()  # and what it records
    app.prompts = []
    app.auth = []

    @app.route("/v1/chat/completions", methods=["POST"])
    def chat(request: Any) -> bytes:
        body = json.loads(request.content.read())
        app.prompts.append(body["messages"][0]["content"])
        app.auth.append(request.getHeader(b"authorization"))
        if busy_after is not None and len(app.prompts) > busy_after:
            request.setResponseCode(503)
            return json.dumps({"error": {"message": "all slots are busy"}}).encode()
        if status != 200:
            request.setResponseCode(status)
            return json.dumps({"error": {"message": "model 'm' not found"}}).encode()
        request.setHeader(b"content-type", b"text/event-stream")
        return (
            b"".join(text(t) for t in "abc")
            + chunk(choices=[], usage={"prompt_tokens": 30, "completion_tokens": 3})
            + b"data: [DONE]\n\n"
        )

    return app


class DriverTests(SynchronousTestCase):
    def drive(self, app: Any, levels: list[int]) -> Deferred[list[Level]]:
        http = StubTreq(app.resource())
        ticks = itertools.count()
        said: list[Level] = []
        self.said = said
        d = Deferred.fromCoroutine(
            bench.run_bench(
                http,
                "http://gw/v1/chat/completions",
                "m",
                levels,
                rounds=2,
                prompt_tokens=5,
                max_tokens=3,
                clock=Clock(),
                now=lambda: next(ticks) * 0.01,
                headers={"authorization": "Bearer k"},
                say=said.append,
            )
        )
        for _ in range(50):
            if d.called:
                break
            http.flush()
        return d

    def test_a_warm_up_then_each_level(self) -> None:
        app = gateway_app()
        levels = self.successResultOf(self.drive(app, [1, 2]))
        self.assertEqual([(lv.concurrency, lv.requests, lv.errors) for lv in levels], [(1, 2, 0), (2, 4, 0)])
        self.assertEqual(self.said, levels)
        self.assertEqual([lv.completion_tokens for lv in levels], [6, 12])
        self.assertTrue(all(lv.gen_tps is not None and lv.gen_tps > 0 for lv in levels))
        self.assertEqual(len(app.prompts), 1 + 2 + 4)
        salts = [p.split(":", 1)[0] for p in app.prompts]
        self.assertEqual(len(set(salts)), len(salts))  # no two prompts share a prefix
        self.assertEqual(set(app.auth), {b"Bearer k"})

    def test_a_refused_warm_up_fails_the_run_with_the_gateways_message(self) -> None:
        failure = self.failureResultOf(self.drive(gateway_app(404), [1]), bench.BenchFailed)
        self.assertIn("HTTP 404: model 'm' not found", str(failure.value))

    def test_a_level_whose_every_request_fails_fails_the_run_with_the_first_error(self) -> None:
        failure = self.failureResultOf(self.drive(gateway_app(busy_after=1), [1]), bench.BenchFailed)
        self.assertEqual(
            str(failure.value), "every request at concurrency 1 failed, the first with: HTTP 503: all slots are busy"
        )

    def test_some_failed_requests_are_counted_not_measured(self) -> None:
        (level,) = self.successResultOf(self.drive(gateway_app(busy_after=2), [2]))
        self.assertEqual((level.requests, level.errors, level.completion_tokens), (4, 3, 3))
