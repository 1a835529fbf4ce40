"""
The bench's own logic (bench/run.py, bench/real.py, bench/relay.py,
bench/relay_engine.py, bench/storecost.py), without wrk, daemons or
sockets: a wrk run's errors are recorded in its figures, never raised; the
better of two runs is one without errors; the targets' verdicts; the relay
ceiling's canned engine writes llama-server's chunked SSE stream, one event
of every stream per step; the store scenario's daemons' configs are
Blazar's, with the setup's C{[cluster]} and a key with every limit, and its
figures are set against SQLite's.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str) -> ModuleType:
    """
    bench/NAME.py as the module C{NAME} (the bench's scripts import each
    other by those names).
    """
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(BENCH / f"{name}.py"):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


run = load("run")
real = load("real")
relay = load("relay")
engine_shim = load("engine_shim")
relay_engine = load("relay_engine")
storecost = load("storecost")


def wrk_output(extra: str = "", distribution: bool = True) -> str:
    """
    What wrk 4.1 prints for a run, with C{extra} lines after its totals.
    """
    head = (
        "Running 2s test @ http://127.0.0.1:8080/v1/chat/completions\n"
        "  1 threads and 64 connections\n"
        "  Thread Stats   Avg      Stdev     Max   +/- Stdev\n"
        "    Latency    18.21ms    2.01ms  30.00ms   80.00%\n"
        "    Req/Sec     3.22k   100.00     3.40k    70.00%\n"
    )
    latency = "  Latency Distribution\n     50%   17.70ms\n     75%   19.01ms\n     90%   20.50ms\n     99%    1.20s\n"
    return (
        head
        + (latency if distribution else "")
        + "  10083 requests in 3.02s, 198.81MB read\n"
        + extra
        + "Requests/sec:   3333.42\nTransfer/sec:     65.73MB\n"
    )


class ParseWrkTests(SynchronousTestCase):
    """
    L{run.parse_wrk}: the figures and the errors of one run.
    """

    def test_clean(self) -> None:
        r = run.parse_wrk(wrk_output())
        self.assertEqual(
            (r["rps"], r["p50_ms"], r["p99_ms"], r["requests"], r["duration_s"]),
            (3333.42, 17.70, 1200.0, 10083, 3.02),
        )
        self.assertEqual((r["errors"], r["first_error"], r["non2xx"]), (0, "", 0))

    def test_non2xx_recorded_not_raised(self) -> None:
        """
        A non-2xx reply is counted, and the first one the script's hook saw
        is named; the run's figures are still there.
        """
        r = run.parse_wrk(
            wrk_output("  Non-2xx or 3xx responses: 1\n"),
            first_reply='503 {"error":{"message":"Loading model"}}',
        )
        self.assertEqual((r["errors"], r["non2xx"], r["rps"]), (1, 1, 3333.42))
        self.assertIn("1 non-2xx", r["first_error"])
        self.assertIn('503 {"error":{"message":"Loading model"}}', r["first_error"])

    def test_socket_errors(self) -> None:
        """
        Socket errors count, except read errors where the engine closes the
        connection after each stream (wrk's reconnects).
        """
        out = wrk_output("  Socket errors: connect 0, read 10083, write 0, timeout 2\n")
        closing = run.parse_wrk(out, closes_after_stream=True)
        self.assertEqual(closing["errors"], 2)
        self.assertEqual(closing["first_error"], "socket errors timeout 2")
        kept = run.parse_wrk(out)
        self.assertEqual(kept["errors"], 10085)
        self.assertEqual(kept["socket_errors"], {"connect": 0, "read": 10083, "write": 0, "timeout": 2})

    def test_no_distribution(self) -> None:
        """
        A run wrk could not finish is an error with what wrk said, and
        figures that no ratio can mistake for a measurement.
        """
        r = run.parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n", returncode=1)
        self.assertEqual((r["rps"], r["requests"], r["errors"]), (0.0, 0, 1))
        self.assertTrue(math.isnan(r["p50_ms"]))
        self.assertIn("Connection refused", r["first_error"])
        self.assertIn("wrk exit 1", r["first_error"])

    def test_script_hook(self) -> None:
        """
        Every script records the first non-2xx reply into the file that
        L{run.wrk} reads.
        """
        script = Path(self.mktemp()).with_suffix(".lua")
        script.parent.mkdir(parents=True, exist_ok=True)
        run.lua_post(script, {"model": "m"}, {"Authorization": "Bearer k"})
        text = script.read_text()
        self.assertIn("response = function(status, headers, body)", text)
        self.assertIn(f'"{run.first_error_path(script)}"', text)
        self.assertIn('wrk.headers["Authorization"] = "Bearer k"', text)


def a_run(rps: float, errors: int = 0, first: str = "") -> dict[str, Any]:
    return {"rps": rps, "errors": errors, "first_error": first, "requests": int(rps * 2)}


class BestRunTests(SynchronousTestCase):
    """
    L{run.best_run}: the better run without errors, and all runs' errors.
    """

    def test_prefers_clean(self) -> None:
        best = run.best_run([a_run(900.0, 1, "1 non-2xx (first: 503 busy)"), a_run(800.0)])
        self.assertEqual(best["rps"], 800.0)
        self.assertEqual((best["errors_all_runs"], best["runs_with_errors"]), (1, 1))
        self.assertEqual(best["first_error_all_runs"], "1 non-2xx (first: 503 busy)")

    def test_all_failing(self) -> None:
        best = run.best_run([a_run(700.0, 2, "a"), a_run(800.0, 1, "b")])
        self.assertEqual((best["rps"], best["errors_all_runs"], best["first_error_all_runs"]), (800.0, 3, "a"))

    def test_ratio(self) -> None:
        self.assertEqual(run.ratio(1.0, 4.0), 0.25)
        self.assertTrue(math.isnan(run.ratio(1.0, 0)))


class VerdictTests(SynchronousTestCase):
    """
    L{real.verdicts}: issue 41's targets, met or not, with the figures.
    """

    summary = {
        "blazar": {
            "cpu_ms_per_request": 0.7,
            "cpu_us_per_chunk": 45.0,
            "cpu_us_per_chunk_marginal": 29.0,
            "kept_c8": 0.95,
            "added_p50_ms": 0.6,
            "added_ttfb_ms": float("nan"),
            "per_core_vs_litellm": 41.0,
        }
    }

    def test_verdicts(self) -> None:
        v = real.verdicts(self.summary, 31000.0)
        self.assertEqual(
            [x["met"] for x in v.values()],
            # CPU/request, CPU/chunk (spread), CPU/chunk (marginal), ceiling, kept c=8, p50, TTFB (NaN), vs LiteLLM
            [True, False, True, True, True, False, None, True],
        )
        self.assertEqual(list(v), list(real.REAL_TARGETS))
        self.assertEqual(v["gateway CPU per non-streamed request (c=1)"]["limit"], "<= 0.8 ms")

    def test_relay_not_run(self) -> None:
        v = real.verdicts(self.summary)
        lines = real.verdict_lines(v)
        self.assertIn(
            "  [not measured] relay ceiling on one core (canned engine, 64 streams; --only relay): - "
            "(target >= 30000 chunks/s)",
            lines,
        )
        self.assertIn("  [MET] gateway CPU per non-streamed request (c=1): 0.700 (target <= 0.8 ms)", lines)
        self.assertIn("  [NOT MET] added p50 at c=1 over direct: 0.600 (target <= 0.5 ms)", lines)


def relay_run(requests: int, cpu_s: float, non2xx: int = 0, first: str = "") -> dict[str, Any]:
    return {
        "rps": requests / 2,
        "p50_ms": 20.0,
        "requests": requests,
        "duration_s": 2.0,
        "non2xx": non2xx,
        "errors": non2xx,
        "first_error": first,
        "cpu_s": cpu_s,
        "engine_cpu_s": 0.5,
        "gateway_core_busy": 0.99,
        "load_core_busy": 0.5,
    }


class RelayTableTests(SynchronousTestCase):
    """
    L{relay.summarize} and L{relay.relay_table}: chunks counted as
    completed streams times events per stream; errors in the target's row.
    """

    def test_summary_and_table(self) -> None:
        runs = {
            "direct": [relay_run(6000, 0.0), relay_run(6400, 0.0)],
            "nginx": [relay_run(5000, 0.8), relay_run(5200, 0.8)],
            "blazar": [relay_run(1100, 2.0, 1, "1 non-2xx (first: 503 busy)"), relay_run(1000, 2.0)],
        }
        s = relay.summarize(runs, {"direct": 100, "nginx": 100, "blazar": None}, {})
        self.assertEqual(s["direct"]["chunks_per_s"], 320000.0)
        self.assertEqual(s["blazar"]["chunks_per_s"], 50000.0)  # the run without errors
        self.assertEqual(s["blazar"]["cpu_us_per_chunk"], 20.0)  # 2 s / 100,000 chunks
        self.assertEqual((s["blazar"]["errors"], s["blazar"]["first_error"]), (1, "1 non-2xx (first: 503 busy)"))
        text = relay.relay_table(
            {
                "summary": s,
                "events_per_stream": {"direct": 100},
                "connections": 64,
                "pinning": "p",
                "seconds_per_run": 2.0,
            }
        )
        blazar_row = next(line for line in text.splitlines() if line.startswith("Blazar "))
        self.assertTrue(blazar_row.rstrip().endswith(" 1"), blazar_row)
        self.assertIn("  Blazar: 1 non-2xx (first: 503 busy)", text)
        self.assertIn("  [MET] relay ceiling on one core: 50000.0 (target >= 30000 chunks/s)", text)
        self.assertIn("  [MET] gateway CPU per relayed chunk: 20.0 (target <= 30 us)", text)

    def test_ceiling_the_worse_reading(self) -> None:
        """
        With the paced engine too, the ceiling is the lesser of the measured
        chunks/s and 1 s over the paced CPU per chunk, the CPU per chunk the
        greater.
        """
        flat = {"direct": [relay_run(6000, 0.0)], "nginx": [relay_run(5000, 0.8)], "blazar": [relay_run(1000, 2.0)]}
        paced = {"direct": [relay_run(500, 0.0)], "blazar": [relay_run(400, 1.6)]}  # 40 us per chunk
        res = {
            "summary": relay.summarize(flat, {"direct": 100}, {}),
            "paced": {
                "summary": relay.summarize(paced, {"direct": 100, "blazar": 100}, {}),
                "step_s": 0.002,
                "offered_chunks_per_s": 32000.0,
            },
            "events_per_stream": {"direct": 100},
            "connections": 64,
            "pinning": "p",
            "seconds_per_run": 2.0,
        }
        top = relay.ceiling(res)
        self.assertEqual((top["chunks_per_s"], top["cpu_us_per_chunk"]), (25000.0, 40.0))
        text = relay.relay_table(res)
        self.assertIn("  [NOT MET] relay ceiling on one core: 25000.0 (target >= 30000 chunks/s)", text)
        self.assertIn("  [NOT MET] gateway CPU per relayed chunk: 40.0 (target <= 30 us)", text)
        self.assertIn("paced: Blazar ", text)


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


class FakeLoop:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def call_soon(self, f: Any) -> None:
        self.calls.append(f)

    def call_later(self, delay: float, f: Any) -> None:
        self.calls.append((delay, f))


def unchunk(data: bytes) -> bytes:
    """
    The body of a chunked transfer, checking its framing.
    """
    body = b""
    while True:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            assert rest == b"\r\n", rest
            return body
        assert rest[n : n + 2] == b"\r\n"
        body, data = body + rest[:n], rest[n + 2 :]


class RelayEngineTests(SynchronousTestCase):
    """
    The relay ceiling's canned engine (bench/relay_engine.py).
    """

    def test_streams_interleave(self) -> None:
        """
        Two streams get one event each per step, each in a chunk of its
        own; each stream is llama-server's canned SSE stream whole, then
        its connection is closed.
        """
        loop = FakeLoop()
        engine = relay_engine.Engine(loop, "relay")
        a, b = FakeTransport(), FakeTransport()
        for t in (a, b):
            connection = relay_engine.Connection(engine)
            connection.connection_made(t)
            request = b'{"model":"relay","stream": true}'
            connection.data_received(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(request)
            )
            connection.data_received(request)
        self.assertEqual(len(loop.calls), 1)  # one stepping loop for all streams
        steps = 0
        while loop.calls:
            loop.calls.pop()()
            steps += 1
            self.assertEqual(len(a.written), len(b.written))
        _, expected = engine_shim.canned("relay")
        for t in (a, b):
            self.assertTrue(t.closed)
            whole = b"".join(t.written)
            head, _, body = whole.partition(b"\r\n\r\n")
            self.assertIn(b"Transfer-Encoding: chunked", head)
            self.assertEqual(unchunk(body).decode(), expected)
            self.assertEqual(len(t.written), engine_shim.CHUNKS + 2)  # [DONE] and the last chunk
        self.assertEqual(steps, engine_shim.CHUNKS + 1)

    def test_paced(self) -> None:
        """
        The paced engine (models C{relay-paced*}) steps every STEP_S seconds.
        """
        loop = FakeLoop()
        engine = relay_engine.Engine(loop, "relay-paced")
        engine.start(FakeTransport())
        self.assertEqual(loop.calls, [(relay_engine.STEP_S, engine.step)])
        self.assertEqual(relay_engine.STEP_S, relay.STEP_S)

    def test_other_requests(self) -> None:
        """
        Health, a non-streamed completion (kept alive, pipelined) and 404.
        """
        engine = relay_engine.Engine(FakeLoop(), "relay")
        t = FakeTransport()
        connection = relay_engine.Connection(engine)
        connection.connection_made(t)
        connection.data_received(
            b"GET /health HTTP/1.1\r\n\r\nPOST /v1/chat/completions HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}"
            b"GET /metrics HTTP/1.1\r\n\r\n"
        )
        self.assertEqual(
            [w.split(b"\r\n")[0] for w in t.written], [b"HTTP/1.1 200 OK"] * 2 + [b"HTTP/1.1 404 Not Found"]
        )
        self.assertTrue(t.written[1].endswith(engine_shim.canned("relay")[0].encode()))
        self.assertFalse(t.closed)


def real_results(failing: dict[str, Any]) -> dict[str, Any]:
    """
    A real-engine scenario's results, every target alike but Blazar's
    C{chat c=64}, which had C{failing}'s errors in one of its two runs.
    """

    def best(rps: float, cpu_s: float, errors: dict[str, Any] | None = None) -> dict[str, Any]:
        runs = [{**a_run(rps), "p50_ms": 3.0, "cpu_s": cpu_s, "requests": int(rps * 5)}]
        runs.append({**runs[0], **errors} if errors else dict(runs[0]))
        out = run.best_run(runs)
        out["cpu_ms_per_request"] = run.ratio(1000 * out["cpu_s"], out["requests"])
        return out

    def rotation(cpu_s: float) -> dict[str, Any]:
        return {t: best(200.0, 0.0 if t == "direct" else cpu_s * (100 if t == "litellm" else 1)) for t in real.TARGETS}

    res: dict[str, Any] = {
        "chunks_per_stream": {"direct": 45},
        "chunks_per_short_stream": {"direct": 3},
        "chat": {c: rotation(0.5) for c in ("1", "8", "64")},
        "stream": {c: rotation(2.0) for c in ("1", "16", "64")},
        "short_stream": {"1": rotation(0.6)},
        "ttfb_ms": {t: 3.0 for t in real.TARGETS},
        "ttfb_errors": {"litellm": "SystemExit: port 1: no event in b''"},
        "warmup_errors": {},
        "litellm_version": "1.0",
        "pinning": "p",
        "seconds_per_run": 5.0,
    }
    res["chat"]["64"]["blazar"] = best(150.0, 0.5, failing)
    res["summary"] = real.summarize(res)
    res["targets"] = real.verdicts(res["summary"])
    return res


class RealTableTests(SynchronousTestCase):
    """
    L{real.real_table}: each target's errors in its row and under the table.
    """

    def test_errors_shown(self) -> None:
        res = real_results({"errors": 1, "first_error": '1 non-2xx (first: 503 {"error":"busy"})', "rps": 900.0})
        self.assertEqual(res["chat"]["64"]["blazar"]["rps"], 150.0)  # the run without errors
        self.assertEqual(res["summary"]["blazar"]["errors"]["count"], 1)
        text = real.real_table(res)
        rows = {line.split("  ")[0]: line for line in text.splitlines()}
        self.assertTrue(rows["Blazar"].endswith(" 1"), rows["Blazar"])
        self.assertTrue(rows["llama-server direct"].endswith(" 0"), rows["llama-server direct"])
        self.assertIn('  Blazar, chat c=64: 1 in 1 of 2 runs; 1 non-2xx (first: 503 {"error":"busy"})', text)
        self.assertIn("  LiteLLM 1.0, 1 worker, ttfb: SystemExit: port 1: no event in b''", text)
        self.assertIn("  [not measured] relay ceiling on one core", text)
        self.assertIn("  [MET] gateway CPU per non-streamed request (c=1): 0.500 (target <= 0.8 ms)", text)


def store_run(rps: float, requests: int, cpu_s: float, p50: float, errors: int = 0) -> dict[str, Any]:
    return {
        "rps": rps,
        "p50_ms": p50,
        "p99_ms": 2 * p50,
        "requests": requests,
        "errors": errors,
        "first_error": "1 non-2xx (first: 503 store_unavailable)" if errors else "",
        "cpu_s": cpu_s,
        "server_cpu_s": cpu_s / 10,
    }


def pair_run(pairs: int, cpu_s: float, p50: float) -> dict[str, Any]:
    return {
        "pairs": pairs,
        "rps": pairs,
        "store_p50_ms": p50,
        "store_p99_ms": 2 * p50,
        "continue_p50_ms": 2 * p50,
        "continue_p99_ms": 4 * p50,
        "errors": 0,
        "first_error": "",
        "cpu_s": cpu_s,
        "server_cpu_s": 0.0,
    }


class StoreScenarioTests(SynchronousTestCase):
    """
    L{storecost}: each setup's daemon config, and the figures per setup
    with their deltas against SQLite's.
    """

    def configs(self) -> dict[str, Any]:
        from blazar.config import parse_config

        work = Path("/srv/bench")
        clusters = storecost.setup_clusters("postgresql://postgres@127.0.0.1:5432/b", "redis://127.0.0.1:6379/3")
        return {
            name: parse_config(storecost.node_config(work, 18080, BENCH / "engine_shim.py", cluster))
            for name, cluster in clusters.items()
        }

    def test_setups(self) -> None:
        """
        Three setups: SQLite with limits in memory, PostgreSQL, and
        PostgreSQL with Redis; without a database, SQLite alone.
        """
        configs = self.configs()
        self.assertEqual(list(configs), list(storecost.SETUPS))
        self.assertEqual(
            {name: (c.cluster.database, c.cluster.redis) for name, c in configs.items()},
            {
                "sqlite": (None, None),
                "postgres": ("postgresql://postgres@127.0.0.1:5432/b", None),
                "postgres+redis": ("postgresql://postgres@127.0.0.1:5432/b", "redis://127.0.0.1:6379/3"),
            },
        )
        self.assertEqual(list(storecost.setup_clusters(None, "redis://127.0.0.1:6379/3")), ["sqlite"])

    def test_config(self) -> None:
        """
        Every setup's daemon serves the canned engine as C{upstream} (and
        its stream as C{upstream-sse}) on its own port and data dir, and has
        one key with every limit, scoped to those models.
        """
        models = ("upstream:latest", "upstream-sse:latest")
        for name, config in self.configs().items():
            self.assertEqual(config.listen, ("tcp:18080:interface=127.0.0.1",), name)
            self.assertEqual(config.data_dir, Path("/srv/bench/data"))
            self.assertEqual(sorted(config.models), sorted(models))
            for model in models:
                self.assertEqual(config.models[model].path, Path("/srv/bench/models/tiny.gguf"))
                self.assertEqual(config.models[model].parallel, 64)
            self.assertEqual(config.llamacpp.binary, BENCH / "engine_shim.py")
            (key,) = config.keys
            self.assertEqual((key.name, key.secret, key.models), ("bench-store", storecost.KEY_SECRET, models))
            self.assertEqual(
                {k: getattr(key, k) for k in storecost.LIMITS},
                storecost.LIMITS,
            )

    def test_summary_against_sqlite(self) -> None:
        """
        Each figure the best of the setup's runs without errors (not all
        from one run), the daemon's CPU per request (and per pair), and each
        figure's delta against SQLite's; a run's errors are shown in its
        setup's row and under the table.
        """
        runs = {
            "sqlite": {"1": [store_run(500.0, 2500, 2.0, 1.8), store_run(600.0, 3000, 3.0, 1.6)], "8": []},
            "postgres": {"1": [store_run(400.0, 2000, 2.4, 2.2)], "8": []},
            "postgres+redis": {
                "1": [store_run(300.0, 1500, 3.0, 3.1, errors=2), store_run(250.0, 1250, 3.0, 3.5)],
                "8": [],
            },
        }
        for setup in runs.values():
            setup["8"] = list(setup["1"])
        pairs = {
            "sqlite": [pair_run(100, 0.5, 2.0)],
            "postgres": [pair_run(80, 0.6, 3.0)],
            "postgres+redis": [pair_run(70, 0.7, 4.0)],
        }
        raw, first = storecost.aggregate(runs, pairs)
        self.assertEqual(raw["sqlite"]["chat"]["1"]["rps"], 600.0)
        self.assertEqual(raw["postgres+redis"]["chat"]["1"]["rps"], 250.0)  # the run without errors
        self.assertEqual(first, {"postgres+redis": "1 non-2xx (first: 503 store_unavailable)"})
        rows = storecost.summarize(raw)
        self.assertAlmostEqual(rows["sqlite"]["c1_cpu_ms"], 0.8)  # 2 s / 2500, the first run's
        self.assertEqual((rows["sqlite"]["c1_rps"], rows["sqlite"]["c1_p50_ms"]), (600.0, 1.6))  # the second's
        self.assertAlmostEqual(rows["postgres"]["c1_cpu_ms"], 1.2)
        self.assertAlmostEqual(rows["postgres+redis"]["c1_cpu_ms"], 2.4)
        self.assertAlmostEqual(rows["postgres+redis"]["c1_cpu_ms_delta"], 1.6)
        self.assertEqual(rows["postgres+redis"]["c1_p50_ms"], 3.5)  # not the failing run's 3.1
        self.assertAlmostEqual(rows["postgres"]["c1_p50_ms_delta"], 0.6)
        self.assertAlmostEqual(rows["sqlite"]["c1_p50_ms_delta"], 0.0)
        self.assertAlmostEqual(rows["postgres"]["pair_cpu_ms"], 7.5)  # 0.6 s / 80 pairs
        self.assertAlmostEqual(rows["postgres"]["pair_cpu_ms_delta"], 2.5)
        self.assertAlmostEqual(rows["postgres+redis"]["continue_p50_ms_delta"], 4.0)
        self.assertEqual(rows["postgres+redis"]["c1_errors"], 2)
        text = storecost.store_table({"summary": rows, "first_errors": first})
        lines = {line.split()[0]: line for line in text.splitlines()[2:]}
        self.assertIn("1.20 (+0.40)", lines["postgres"])
        self.assertNotIn("(+", lines["sqlite"])
        self.assertTrue(lines["postgres+redis"].endswith("ERRORS 4"), lines["postgres+redis"])
        self.assertIn("  postgres+redis's first error: 1 non-2xx (first: 503 store_unavailable)", text)
        tpm = {"20000": {"checks": 20, "redis_cpu_ms": 21.5, "wall_ms": 22.25}}
        text = storecost.store_table({"summary": rows, "tpm_check_by_window": tpm})
        self.assertIn("   20,000 answers: 21.500 ms / 22.250 ms", text)

    def test_helpers(self) -> None:
        """
        Nearest-rank percentiles; CPU spent across two readings of a
        process tree counts a process born in between from 0.
        """
        self.assertEqual(storecost.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50), 3.0)
        self.assertEqual(storecost.percentile([float(n) for n in range(1, 101)], 99), 99.0)
        self.assertTrue(math.isnan(storecost.percentile([], 50)))
        self.assertAlmostEqual(storecost.cpu_spent({1: 1.0, 2: 5.0}, {1: 1.5, 2: 5.25, 3: 0.5}), 1.25)
