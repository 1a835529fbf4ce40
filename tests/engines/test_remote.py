"""
Remotes ([[remotes]]): the config, the names they are reached by, the
instance the request path is handed, the key's handling, the model
catalog, and the supervisor's breaker for a remote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twisted.internet.defer import ensureDeferred, fail, succeed
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import ConfigError, RemoteConfig, parse_config
from blazar.engines.remote import RemoteCatalog, RemoteInstance, auth_headers, listed_models, scrub, scrub_bytes
from blazar.engines.supervisor import BreakerOpen, EngineCrashed, Supervisor
from blazar.models.registry import ModelNotFound, ModelRegistry
from blazar.testing import fake_process_reactor

PEER = '[[remotes]]\nname = "peer"\nbase_url = "http://10.0.0.2:8080/v1/"\napi_key = "sk-peer-0123456789"\n'


class RemoteConfigTests(SynchronousTestCase):
    def test_defaults_and_root(self) -> None:
        (remote,) = parse_config(PEER).remotes
        self.assertEqual(
            (remote.name, remote.api, remote.models, remote.max_concurrent, remote.timeout),
            ("peer", "openai", ("*",), 4, 120.0),
        )
        self.assertEqual(remote.root, "http://10.0.0.2:8080")
        self.assertNotIn("sk-peer", repr(remote))

    def test_every_key(self) -> None:
        config = parse_config(
            '[[remotes]]\nname = "claude"\nbase_url = "https://api.anthropic.com"\napi = "anthropic"\n'
            'api_key_env = "ANTHROPIC_API_KEY"\nmodels = ["claude-sonnet-4-5"]\nmax_concurrent = 8\n'
            "timeout_secs = 30\n"
        )
        remote = config.remote("Claude")
        assert remote is not None
        self.assertEqual(
            (remote.api, remote.models, remote.max_concurrent, remote.timeout, remote.root),
            ("anthropic", ("claude-sonnet-4-5",), 8, 30.0, "https://api.anthropic.com"),
        )
        self.assertEqual(remote.key({"ANTHROPIC_API_KEY": "k-1"}), "k-1")
        self.assertIsNone(remote.key({}))

    def test_teaching_errors(self) -> None:
        cases = {
            'name = "peer"\nbase_url = "ftp://x"': "base_url",
            'name = "peer"\nbase_url = "http://x"\napi = "grpc"': "api",
            'name = "a:b"\nbase_url = "http://x"': "name",
            'name = "peer"\nbase_url = "http://x"\napi_key = "k"\napi_key_env = "K"': "not both",
            'name = "peer"\nbase_url = "http://x"\nmodels = []': "models",
            'name = "peer"\nbase_url = "http://x"\nmax_concurrent = 0': "max_concurrent",
            'name = "peer"\nbase_url = "http://x"\nsecret = "x"': "secret",
        }
        for table, named in cases.items():
            with self.assertRaises(ConfigError, msg=table) as caught:
                parse_config("[[remotes]]\n" + table + "\n")
            self.assertIn(named, str(caught.exception))
        with self.assertRaises(ConfigError) as caught:
            parse_config(PEER + PEER)
        self.assertIn("two remotes", str(caught.exception))

    def test_headers_by_api(self) -> None:
        openai = RemoteConfig("p", "http://x", api_key="sk-1")
        self.assertEqual(auth_headers(openai, {}), {b"authorization": [b"Bearer sk-1"]})
        claude = RemoteConfig("c", "http://x", api="anthropic", api_key_env="K")
        self.assertEqual(
            auth_headers(claude, {"K": "ak"}), {b"anthropic-version": [b"2023-06-01"], b"x-api-key": [b"ak"]}
        )
        self.assertEqual(auth_headers(RemoteConfig("o", "http://x", api="ollama"), {}), {})

    def test_scrub(self) -> None:
        remote = RemoteConfig("p", "http://x", api_key="sk-secret-1")
        self.assertEqual(
            scrub("Incorrect API key provided: sk-secret-1.", remote, {}), "Incorrect API key provided: [redacted]."
        )
        self.assertEqual(scrub("BEARER SK-SECRET-1", remote, {}), "BEARER [redacted]")
        self.assertEqual(scrub_bytes(b'{"e":"sk-secret-1"}', remote, {}), b'{"e":"[redacted]"}')

    def test_no_password_in_a_url(self) -> None:
        with self.assertRaises(ConfigError) as caught:
            parse_config('[[remotes]]\nname = "p"\nbase_url = "http://bob:hunter2@10.0.0.2/v1"\n')
        self.assertIn("user:password@", str(caught.exception))
        self.assertNotIn("hunter2", str(caught.exception))

    def test_listed_models(self) -> None:
        self.assertEqual(listed_models(b'{"object":"list","data":[{"id":"b"},{"id":"a"},{"x":1}]}'), ("a", "b"))
        self.assertEqual(listed_models(b'{"models":[{"name":"llama3:8b"}]}'), ("llama3:8b",))
        with self.assertRaises(ValueError):
            listed_models(b"[]")


class RegistryTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.root = Path(self.mktemp())
        self.root.mkdir()
        (self.root / "peer.gguf").write_bytes(b"GGUF")  # a local model that an Ollama name:tag would also hit
        self.config = parse_config(
            f'models_dir = "{self.root}"\n' + PEER.replace("/v1/", "") + 'models = ["tiny"]\n'
            '[[remotes]]\nname = "any"\nbase_url = "http://h"\n'
        )
        self.registry = ModelRegistry(self.config, fake_process_reactor())

    def resolve(self, name: str) -> Any:
        return self.successResultOf(ensureDeferred(self.registry.resolve(name)))

    def test_remote_names_first(self) -> None:
        entry = self.resolve("peer:tiny")
        self.assertEqual(
            (entry.name, entry.format, entry.remote, entry.remote_model), ("peer:tiny", "remote", "peer", "tiny")
        )
        self.assertEqual(self.resolve("peer").name, "peer:latest")  # the local file, by its own name
        self.registry.note_listed("any", ("whatever/model-1",))
        self.assertEqual(self.resolve("any:whatever/model-1").remote_model, "whatever/model-1")

    def test_a_star_remote_serves_what_it_lists_asked_again_for_another_name(self) -> None:
        asked: list[str] = []

        async def relist(name: str) -> None:
            asked.append(name)
            self.registry.note_listed(name, ("m1", "pulled-just-now"))

        self.registry.relist = relist
        self.assertEqual(self.resolve("any:pulled-just-now").remote_model, "pulled-just-now")
        self.assertEqual(asked, ["any"])
        self.registry.note_listed("any", ("m1", "tiny:latest"))
        self.assertEqual(self.resolve("any:tiny").name, "any:tiny:latest")  # a bare name means :latest, as there
        failure = self.failureResultOf(ensureDeferred(self.registry.resolve("any:never")), ModelNotFound)
        self.assertIn("any:m1", failure.value.available)
        # a name no remote could have is not even asked about (its series, breaker and queue would be per name)
        for bad in ("x" * 201, "has space", "tab\tname", "nul\x00"):
            self.failureResultOf(ensureDeferred(self.registry.resolve("any:" + bad)), ModelNotFound)
        self.assertEqual(asked, ["any", "any"])

    def test_a_model_the_remote_does_not_list(self) -> None:
        failure = self.failureResultOf(ensureDeferred(self.registry.resolve("peer:other")), ModelNotFound)
        self.assertIn("peer:tiny", failure.value.available)

    def test_listed(self) -> None:
        names = [e.name for e in self.successResultOf(ensureDeferred(self.registry.refresh()))]
        self.assertEqual(names, ["peer:latest", "peer:tiny"])
        self.assertEqual(self.registry._shadowed, {"peer:latest"})  # named in a warning: peer:latest is the remote's
        self.registry.note_listed("any", ("m1", "m2"))
        names = [e.name for e in self.successResultOf(ensureDeferred(self.registry.refresh()))]
        self.assertEqual(names, ["any:m1", "any:m2", "peer:latest", "peer:tiny"])


class CatalogTests(SynchronousTestCase):
    def test_relist_asks_once_for_all_and_not_again_at_once(self) -> None:
        config = parse_config('[[remotes]]\nname = "a"\nbase_url = "http://a"\n')
        answers: list[Any] = []

        def get(url: str, headers: Any, timeout: float) -> Any:
            d: Any = __import__("twisted.internet.defer", fromlist=["Deferred"]).Deferred()
            answers.append(d)
            return d

        noted: list[Any] = []
        clock = Clock()
        catalog = RemoteCatalog(lambda: config, get, lambda *a: noted.append(a), clock)
        first, second = ensureDeferred(catalog.relist("a")), ensureDeferred(catalog.relist("a"))
        self.assertEqual(len(answers), 1)  # one question for both
        answers[0].callback((200, b'{"data":[{"id":"m"}]}'))
        self.successResultOf(first)
        self.successResultOf(second)
        self.assertEqual(noted, [("a", ("m",))])
        self.successResultOf(ensureDeferred(catalog.relist("a")))
        self.assertEqual(len(answers), 1)  # not again within `again` seconds
        clock.advance(catalog.again)
        ensureDeferred(catalog.relist("a"))
        self.assertEqual(len(answers), 2)

    def test_other_lanes_models_are_not_listed(self) -> None:
        body = (
            b'{"data":[{"id":"tiny:latest","kind":"chat"},{"id":"w","kind":"transcription"},'
            b'{"id":"i","kind":"image"},{"id":"r","kind":"rerank"},{"id":"e","kind":"embedding"}]}'
        )
        self.assertEqual(listed_models(body), ("e", "tiny:latest"))

    def test_asks_star_remotes_and_survives_failures(self) -> None:
        config = parse_config(
            '[[remotes]]\nname = "a"\nbase_url = "http://a/v1"\napi_key = "sk-a-123"\n'
            '[[remotes]]\nname = "b"\nbase_url = "http://b"\nmodels = ["x"]\n'
        )
        asked: list[tuple[str, Any]] = []
        answers = [fail(ConnectionRefusedError()), succeed((200, b'{"data":[{"id":"m"}]}'))]

        def get(url: str, headers: Any, timeout: float) -> Any:
            asked.append((url, headers))
            return answers.pop(0)

        noted: list[Any] = []
        clock = Clock()
        catalog = RemoteCatalog(lambda: config, get, lambda *a: noted.append(a), clock)
        catalog.start()
        self.assertEqual(asked, [("http://a/v1/models", {b"authorization": [b"Bearer sk-a-123"]})])
        self.assertEqual(noted, [])
        clock.advance(60)
        self.assertEqual(noted, [("a", ("m",))])
        catalog.stop()


class SupervisorRemoteTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = fake_process_reactor()
        config = parse_config("breaker_crashes = 2\n" + PEER + 'models = ["tiny"]\n')
        registry = ModelRegistry(config, self.reactor)
        self.supervisor = Supervisor(config, registry, self.reactor, lambda url: succeed(200), {})

    def instance(self) -> Any:
        return self.successResultOf(ensureDeferred(self.supervisor.instance_for("peer:tiny")))

    def test_an_instance_that_never_spawns(self) -> None:
        instance = self.instance()
        self.assertIsInstance(instance, RemoteInstance)
        self.assertEqual(
            (instance.base_url, instance.lane, instance.state), ("http://10.0.0.2:8080", "remote", "ready")
        )
        self.assertIs(self.instance(), instance)
        self.assertEqual(self.reactor.spawned, [])
        self.assertEqual(self.supervisor.snapshot(), [])  # not a child: not in /api/ps
        self.assertFalse(self.supervisor.exited(instance))
        self.successResultOf(self.supervisor.stop_instance(instance, "keep_alive 0"))

    def test_failures_open_its_breaker(self) -> None:
        instance = self.instance()
        error = self.successResultOf(
            ensureDeferred(
                self.supervisor.explain_failure(instance, ConnectionRefusedError("sk-peer-0123456789 refused"))
            )
        )
        self.assertIsInstance(error, EngineCrashed)
        self.assertIn("remote 'peer'", str(error))
        self.assertNotIn("sk-peer-0123456789", str(error))
        self.supervisor.remote_failed(instance, "status 500: boom")
        failure = self.failureResultOf(ensureDeferred(self.supervisor.instance_for("peer:tiny")), BreakerOpen)
        self.assertIn("remote 'peer'", str(failure.value))
        self.assertEqual(self.supervisor.reset_breakers(), ["peer:*"])  # one breaker for the remote
        self.assertIs(self.instance(), instance)


class ScopeTests(SynchronousTestCase):
    def test_a_scoped_key_reaches_its_remote_model_exactly(self) -> None:
        from blazar.config import KeyConfig
        from blazar.gateway.context import RequestContext
        from blazar.gateway.scope import resolve_in_scope

        config = parse_config('[[remotes]]\nname = "peer"\nbase_url = "http://h"\n')
        registry = ModelRegistry(config, fake_process_reactor())
        registry.note_listed("peer", ("tiny", "Tiny"))  # a remote's ids are case-sensitive: two models

        class Request:
            blazar = RequestContext(key=KeyConfig("k", "k" * 16, ("peer:tiny",)))

        entry = self.successResultOf(ensureDeferred(resolve_in_scope(Request.blazar, registry, "PEER:tiny")))
        self.assertEqual(entry.remote_model, "tiny")
        failure = self.failureResultOf(
            ensureDeferred(resolve_in_scope(Request.blazar, registry, "peer:Tiny")), ModelNotFound
        )
        self.assertEqual(failure.value.available, ["peer:tiny"])
