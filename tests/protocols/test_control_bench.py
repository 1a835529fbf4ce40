"""
The bench commands of the control channel (C{BenchRecord},
C{BenchHistory}) over an in-memory AMP connection, against a supervisor on
a fake process reactor, the bench history in a real SQLite file (its
calls run at once: L{blazar.gateway.bench.BenchRecords} only ever calls
C{run_db}) and a fake NVML's census.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.protocols import amp
from twisted.test.iosim import connectedServerAndClient
from twisted.trial.unittest import SynchronousTestCase

from blazar import store
from blazar.engines import bench
from blazar.engines.supervisor import Supervisor
from blazar.gateway.bench import KEY_MARK, BenchRecords, engine_tag, recorded_argv
from blazar.models.registry import ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.protocols.control import BenchError, BenchHistory, BenchRecord, ControlServer, ModelError
from blazar.testing import FakeNVML, fake_process_reactor

GIB = 1 << 30


def a_run(gen_tps: float = 50.0) -> str:
    level = {**bench.summarise(1, [], 1.0).to_json(), "requests": 2, "gen_tps": gen_tps, "ttft_ms": 20.0}
    return json.dumps(
        {
            "settings": {
                "prompt_tokens": 64,
                "max_tokens": 16,
                "rounds": 2,
                "concurrency": [1],
                "url": "http://127.0.0.1:1/v1/chat/completions",
            },
            "levels": [level],
        }
    )


class BenchCommandTests(SynchronousTestCase):
    def setUp(self) -> None:
        from blazar.config import LiveConfig, parse_config

        root = Path(self.mktemp())
        make_test_model(root / "models" / "m.gguf")
        self.reactor = fake_process_reactor()

        async def probe(url: str) -> int:
            return 200

        live = LiveConfig(
            parse_config(
                f'models_dir = "{root / "models"}"\ndata_dir = "{root / "data"}"\n'
                '[models."m"]\nthreads = 3\n[engines.llamacpp]\nbinary = "/bin/true"\n'
            )
        )
        self.registry = ModelRegistry(live, self.reactor)
        self.supervisor = Supervisor(live, self.registry, self.reactor, probe, {}, port_finder=lambda: 5555)
        self.db = store.thd_open(root / "blazar.db")
        self.addCleanup(self.db.close)
        census = FakeNVML.with_gpus(24 * GIB, cpu_physical_cores=6).thd_census()

        def run_db(f: Any, *args: Any) -> Deferred[Any]:
            return maybeDeferred(f, self.db, *args)

        self.records = BenchRecords(self.registry, self.supervisor, run_db, lambda: succeed(census), lambda: 1000.0)
        self.client, self.server, self.pump = connectedServerAndClient(
            lambda: ControlServer(self.supervisor, self.registry, lambda: {}, self.reactor, bench=self.records),
            amp.AMP,
        )

    def call(self, command: Any, **kw: Any) -> Deferred[Any]:
        result: list[Any] = []
        self.client.callRemote(command, **kw).addBoth(result.append)
        self.pump.flush()
        (value,) = result
        d: Deferred[Any] = Deferred()
        d.callback(value)
        return d

    def load(self) -> Any:
        return self.successResultOf(Deferred.fromCoroutine(self.supervisor.instance_for("m")))

    def test_a_run_is_recorded_with_the_childs_profile_engine_and_hardware(self) -> None:
        instance = self.load()
        stored = json.loads(self.successResultOf(self.call(BenchRecord, model="m", run=a_run()))["bench"])
        self.assertEqual((stored["id"], stored["model"], stored["created"]), (1, "m:latest", 1000.0))
        self.assertEqual(stored["engine"], "/bin/true")  # not an installed engine, not in a build's bin/
        argv = stored["profile"]["argv"]
        self.assertEqual(argv, recorded_argv(instance.argv, instance.api_key))
        self.assertEqual(argv[0], "/bin/true")
        self.assertNotIn("--port", argv)
        self.assertEqual(argv[argv.index("--threads") + 1], "3")  # the model's profile, as the child got it
        self.assertEqual(stored["profile"]["ctx"], instance.ctx)
        self.assertEqual(stored["hardware"]["cpu_physical_cores"], 6)
        self.assertEqual([(g["index"], g["memory_total"]) for g in stored["hardware"]["gpus"]], [(0, 24 * GIB)])
        self.assertEqual(stored["levels"][0]["gen_tps"], 50.0)
        self.assertEqual(stored["settings"]["concurrency"], [1])
        (row,) = store.thd_bench_history(self.db, "m:latest", 10)  # the row landed
        self.assertEqual(row[0], 1)

    def test_an_installed_engine_is_named_by_its_tag(self) -> None:
        self.db.execute(
            "INSERT INTO engines (kind, tag, source, sha256, path, installed_at, active) VALUES "
            "('llamacpp', 'b7000', 'url:x', 'h', '/bin/true', 1.0, 1)"
        )
        self.load()
        stored = json.loads(self.successResultOf(self.call(BenchRecord, model="m", run=a_run()))["bench"])
        self.assertEqual(stored["engine"], "llamacpp@b7000")

    def test_history_newest_first_and_the_latest_against_the_one_before(self) -> None:
        self.load()
        for rate in (50.0, 40.0):
            self.successResultOf(self.call(BenchRecord, model="m", run=a_run(rate)))
        answer = self.successResultOf(self.call(BenchHistory, model="m"))
        runs = json.loads(answer["runs"])
        self.assertFalse(answer["truncated"])
        self.assertEqual([r["id"] for r in runs], [2, 1])
        comparison = bench.compare(runs[1], runs[0])
        self.assertEqual(comparison["levels"][0]["gen_tps"]["delta_percent"], -20.0)
        self.assertEqual(comparison["changes"], [])
        self.assertEqual(json.loads(self.successResultOf(self.call(BenchHistory, limit=1))["runs"])[0]["id"], 2)
        # a name no model has (deleted since) reads what was recorded under it
        self.assertEqual(json.loads(self.successResultOf(self.call(BenchHistory, model="gone:latest"))["runs"]), [])

    def test_history_fits_an_amp_value(self) -> None:
        instance = self.load()
        instance.argv = (*instance.argv, *("--flag", "x" * 2000))
        for _ in range(40):
            self.successResultOf(self.call(BenchRecord, model="m", run=a_run()))
        answer = self.successResultOf(self.call(BenchHistory, model="m", limit=40))
        self.assertTrue(answer["truncated"])
        runs = json.loads(answer["runs"])
        self.assertEqual(runs[0]["id"], 40)  # the newest kept
        self.assertLess(len(answer["runs"].encode()), 65_000)

    def test_refusals_keep_the_connection(self) -> None:
        failure = self.failureResultOf(self.call(BenchRecord, model="m", run=a_run()), BenchError)
        self.assertIn("not loaded", str(failure.value))
        self.failureResultOf(self.call(BenchRecord, model="nope", run=a_run()), ModelError)
        self.load()
        self.failureResultOf(self.call(BenchRecord, model="m", run="{"), BenchError)
        bad = json.loads(a_run())
        bad["levels"][0]["gen_tps"] = -1
        failure = self.failureResultOf(self.call(BenchRecord, model="m", run=json.dumps(bad)), BenchError)
        self.assertIn("gen_tps", str(failure.value))
        self.assertEqual(json.loads(self.successResultOf(self.call(BenchHistory))["runs"]), [])


class RecordedShapeTests(SynchronousTestCase):
    def test_the_port_and_a_childs_key_are_left_out(self) -> None:
        self.assertEqual(
            recorded_argv(["vllm", "--port", "5555", "--api-key", "s3cret", "--x", "a-s3cret"], "s3cret"),
            ["vllm", "--api-key", KEY_MARK, "--x", f"a-{KEY_MARK}"],
        )

    def test_engine_tags(self) -> None:
        self.assertEqual(engine_tag("/any/path", "llamacpp@b7000"), "llamacpp@b7000")
        self.assertEqual(
            engine_tag("/home/u/.cache/blazar/engines/llamacpp-11434.0.0-native-off/bin/llama-server", None),
            "llamacpp-11434.0.0-native-off",
        )
        self.assertEqual(engine_tag("/usr/local/llama-server", None), "/usr/local/llama-server")
