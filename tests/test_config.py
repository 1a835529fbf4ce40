import re
import socket
from pathlib import Path

import pytest
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import (
    DEFAULT_LISTEN,
    Config,
    ConfigError,
    config_path,
    load_config,
    node_name,
    node_url,
    parse_config,
)
from blazar.names import canonical_name, name_key


class ParseConfigTests(SynchronousTestCase):
    def test_empty_gives_defaults(self) -> None:
        c = parse_config("")
        self.assertEqual(c.listen, (DEFAULT_LISTEN,))
        self.assertEqual(c.resolved_models_dir, c.data_dir / "models")
        self.assertEqual(c.models, {})

    def test_listen_string_or_list(self) -> None:
        self.assertEqual(parse_config('listen = "tcp:1"').listen, ("tcp:1",))
        self.assertEqual(parse_config('listen = ["tcp:1", "unix:/x"]').listen, ("tcp:1", "unix:/x"))

    def test_models_dir_default_follows_data_dir(self) -> None:
        c = parse_config('data_dir = "/srv/b"')
        self.assertEqual(c.resolved_models_dir, Path("/srv/b/models"))

    def test_model_table(self) -> None:
        c = parse_config(
            'models_dir = "/m"\n[models."qwen"]\npath = "q.gguf"\nctx_size = 8192\n'
            'parallel = 2\nembedding = true\nargs = ["--flash-attn", "on"]\n'
        )
        m = c.models["qwen:latest"]
        self.assertEqual(m.path, Path("/m/q.gguf"))
        self.assertEqual((m.ctx_size, m.parallel, m.embedding), (8192, 2, True))
        self.assertEqual(m.args, ("--flash-attn", "on"))

    def test_cluster_redis(self) -> None:
        """
        C{[cluster] redis}: a Redis URL, kept out of the repr (it may hold
        a password); anything else is refused naming the key.
        """
        c = parse_config('[cluster]\nredis = "redis://:hunter2-secret@10.0.0.5:6379/1"\n')
        self.assertEqual(c.cluster.redis, "redis://:hunter2-secret@10.0.0.5:6379/1")
        self.assertNotIn("hunter2", repr(c.cluster))
        self.assertIsNone(parse_config("").cluster.redis)
        self.assertConfigError('[cluster]\nredis = "http://x:6379"\n', "redis")

    def test_cluster_node(self) -> None:
        """
        C{[cluster] node}: this node's name; unset, the host name and a
        hash of the data_dir (one per data_dir, the same at every start).
        """
        self.assertEqual(node_name(parse_config('[cluster]\nnode = "gpu-1"\n')), "gpu-1")
        one, two = parse_config('data_dir = "/srv/a"'), parse_config('data_dir = "/srv/b"')
        self.assertEqual(node_name(one), node_name(parse_config('data_dir = "/srv/a"')))
        self.assertNotEqual(node_name(one), node_name(two))
        self.assertTrue(node_name(one).startswith(socket.gethostname() + "-"))
        self.assertConfigError('[cluster]\nnode = " "\n', "node")
        self.assertConfigError('[cluster]\nnode = "a\\nb"\n', "node")

    def test_cluster_url(self) -> None:
        """
        C{[cluster] url}: where other nodes reach this one; unset, made
        from the first TCP or TLS listener (the host's name for every
        interface), C{""} with none.
        """
        self.assertEqual(node_url(parse_config('[cluster]\nurl = "http://gpu-2:8080/"\n')), "http://gpu-2:8080")
        self.assertEqual(node_url(parse_config('listen = "tcp:9000:interface=10.0.0.5"')), "http://10.0.0.5:9000")
        self.assertEqual(
            node_url(parse_config('listen = ["unix:/tmp/b.sock", "ssl:9443:interface=\\\\:\\\\:1"]')),
            "https://[::1]:9443",
        )
        self.assertEqual(node_url(parse_config('listen = "tcp:9000"')), f"http://{socket.getfqdn()}:9000")
        self.assertEqual(node_url(parse_config('listen = "unix:/tmp/b.sock"')), "")
        self.assertConfigError('[cluster]\nurl = "gpu-2:8080"\n', "url")

    def test_engine_binary(self) -> None:
        c = parse_config('[engines.llamacpp]\nbinary = "/opt/llama-server"\nargs = ["-t", "2"]')
        self.assertEqual(c.llamacpp.binary, Path("/opt/llama-server"))
        self.assertEqual(c.llamacpp.args, ("-t", "2"))

    def assertConfigError(self, text: str, *needles: str) -> None:
        with self.assertRaises(ConfigError) as cm:
            parse_config(text, Path("/etc/b.toml"))
        message = str(cm.exception)
        self.assertIn("/etc/b.toml", message)
        for needle in needles:
            self.assertIn(needle, message)

    def test_non_finite_numbers_refused(self) -> None:
        self.assertConfigError("[queue]\ndeadline_normal_secs = inf\n", "queue.deadline_normal_secs")
        self.assertConfigError("[queue]\ndeadline_low_secs = nan\n", "queue.deadline_low_secs")
        self.assertConfigError("idle_timeout_secs = inf\n", "idle_timeout_secs")
        self.assertConfigError(
            '[[keys]]\nname = "k"\nsecret = "0123456789abcdef"\nweight = inf\n',
            "keys[0].weight",
            "share of busy slots",
        )

    def test_door_settings(self) -> None:
        c = parse_config("")
        self.assertEqual(
            (c.header_timeout, c.body_min_bytes_per_sec, c.max_connections_per_ip, c.metrics_require_key),
            (10.0, 4096, 64, None),  # None: once keys exist, /metrics needs an admin key (as true)
        )
        c = parse_config(
            "header_timeout_secs = 2.5\nbody_min_bytes_per_sec = 100\nmax_connections_per_ip = 0\n"
            "metrics_require_key = false\n"
        )
        self.assertEqual(
            (c.header_timeout, c.body_min_bytes_per_sec, c.max_connections_per_ip, c.metrics_require_key),
            (2.5, 100, 0, False),
        )
        self.assertConfigError("header_timeout_secs = 0", "'header_timeout_secs'", "positive")
        self.assertConfigError("header_timeout_secs = inf", "'header_timeout_secs'")
        self.assertConfigError("body_min_bytes_per_sec = 1.5", "'body_min_bytes_per_sec'", "positive integer")
        self.assertConfigError("max_connections_per_ip = -1", "'max_connections_per_ip'", "0 (no limit)")
        self.assertConfigError("max_connections_per_ip = true", "'max_connections_per_ip'")

    def test_ctx_policy(self) -> None:
        self.assertEqual(parse_config("").ctx_policy, "grow")
        self.assertEqual(parse_config('ctx_policy = "fit"').ctx_policy, "fit")
        # the earlier name, kept so existing configs still start
        self.assertEqual(parse_config('ctx_policy = "reload"').ctx_policy, "grow")
        self.assertConfigError('ctx_policy = "shrink"', "'ctx_policy'", '"grow" or "fit"')

    def test_unknown_top_key(self) -> None:
        self.assertConfigError("lisen = 'tcp:1'", "'lisen'", "listen")

    def test_unknown_model_key(self) -> None:
        self.assertConfigError("[models.a]\nctx = 1", "'models.a.ctx'", "ctx_size")

    def test_unknown_engine_key(self) -> None:
        self.assertConfigError('[engines.llamacpp]\nbin = "x"', "'engines.llamacpp.bin'")

    def test_wrong_types(self) -> None:
        self.assertConfigError("listen = 5", "'listen'", "int")
        self.assertConfigError("data_dir = 1", "'data_dir'")
        self.assertConfigError("ready_timeout = -1", "'ready_timeout'", "positive")
        self.assertConfigError('[models.a]\nctx_size = "big"', "'models.a.ctx_size'", "positive integer")
        self.assertConfigError("[models.a]\nembedding = 1", "'models.a.embedding'", "true or false")
        # a list or table where a lane's name goes was a TypeError (unhashable) out of the lane check
        self.assertConfigError("[models.a]\nengine = []", "'models.a.engine'", "got list")
        self.assertConfigError("[models.a]\nengine = {x = 1}", "'models.a.engine'", "got dict")
        self.assertConfigError('[models.a]\nargs = "-x"', "'models.a.args'", "list of strings")
        self.assertConfigError("[models.a]\nparallel = true", "'models.a.parallel'")

    def test_not_toml(self) -> None:
        self.assertConfigError("listen = [", "not valid TOML")

    def test_bad_model_name(self) -> None:
        self.assertConfigError('[models."bad name!"]\nctx_size = 1', "invalid model name")


class ConfigPathTests(SynchronousTestCase):
    def test_order(self) -> None:
        self.assertEqual(config_path("/a.toml", {"BLAZAR_CONFIG": "/b.toml"}), Path("/a.toml"))
        self.assertEqual(config_path(None, {"BLAZAR_CONFIG": "/b.toml"}), Path("/b.toml"))
        self.assertEqual(config_path(None, {}).name, "config.toml")

    def test_missing_default_file_is_defaults(self) -> None:
        self.assertEqual(load_config(Path(self.mktemp())), Config())

    def test_missing_named_file_is_error(self) -> None:
        with self.assertRaises(ConfigError):
            load_config(Path(self.mktemp()), required=True)


class NameTests(SynchronousTestCase):
    def test_bare_name_means_latest(self) -> None:
        self.assertEqual(canonical_name("llama3"), "llama3:latest")
        self.assertEqual(canonical_name("llama3:8b"), "llama3:8b")
        self.assertEqual(canonical_name("library/llama3"), "library/llama3:latest")
        self.assertEqual(canonical_name("qwen2.5-coder:1.5b-q4_K_M"), "qwen2.5-coder:1.5b-q4_K_M")

    def test_case_insensitive_key(self) -> None:
        self.assertEqual(name_key("Llama3"), name_key("llama3:LATEST"))

    def test_invalid(self) -> None:
        for bad in ["", "a b", ":tag", "a:", "a:b:c", "../x", "-x"]:
            with self.assertRaises(ValueError, msg=bad):
                canonical_name(bad)


class ReloadTableTests(SynchronousTestCase):
    def test_every_field_is_classified(self) -> None:
        import attrs

        from blazar.config import RELOAD_TABLE, RESTART, RUNTIME

        self.assertEqual(set(RELOAD_TABLE), {f.name for f in attrs.fields(Config)})
        self.assertEqual({kind for _, kind in RELOAD_TABLE.values()}, {RUNTIME, RESTART})
        self.assertEqual(
            sorted(k for k, kind in RELOAD_TABLE.values() if kind == RESTART),
            ["audit_log", "cluster", "data_dir", "engine_check_secs", "engine_index_url", "listen", "otlp_endpoint"],
        )

    def test_table_names_are_the_files_keys(self) -> None:
        from blazar.config import RELOAD_TABLE

        # each name parses as a config-file key (nested ones by their table)
        for name, (key, _) in RELOAD_TABLE.items():
            if name == "source":
                continue
            try:  # a dotted key is a nested table: {} is valid there, a wrong type elsewhere
                parse_config(f"{key} = {{}}")
            except ConfigError as e:
                self.assertNotIn("unknown key", str(e), key)

    def test_changes_are_named_key_by_key(self) -> None:
        from blazar.config import config_changes

        old = parse_config('listen = "tcp:1"\n[models."a"]\nctx_size = 1024\n[models."b"]\nctx_size = 1024\n')
        new = parse_config(
            'listen = "tcp:2"\nchild_header_timeout_secs = 5\nkeep_alive = "1m"\n[queue]\nmax_waiting = 3\n'
            'deadline_high_secs = 1\n[engines.llamacpp]\nargs = ["-t", "2"]\n'
            '[models."a"]\nctx_size = 2048\n[models."b"]\nctx_size = 1024\n[models."c"]\n'
            '[[keys]]\nname = "k"\nsecret = "k-secret-0123456789abc"\n'
        )
        report = config_changes(old, new)
        self.assertEqual(report.restart, ("listen",))
        self.assertEqual(
            report.applied,
            (
                "keep_alive",
                "child_header_timeout_secs",
                "engines.llamacpp.args",
                "queue.deadline_high_secs",
                "queue.max_waiting",
                'models."a:latest"',
                'models."c:latest"',
                "keys",
            ),
        )
        self.assertEqual(config_changes(new, new).applied, ())


class LiveConfigTests(SynchronousTestCase):
    def test_swap_applies_runtime_keys_keeps_restart_keys_and_notifies(self) -> None:
        from blazar.config import LiveConfig

        live = LiveConfig(parse_config('listen = "tcp:1"\ndata_dir = "/a"\n'))
        seen: list[Config] = []
        live.subscribe(seen.append)
        report = live.swap(parse_config('listen = "tcp:2"\ndata_dir = "/b"\nmax_body_bytes = 10\n'))
        self.assertEqual((report.applied, report.restart), (("max_body_bytes",), ("listen", "data_dir")))
        self.assertIs(live(), live.current)
        self.assertEqual(live.current.max_body_bytes, 10)
        self.assertEqual((live.current.listen, live.current.data_dir), (("tcp:1",), Path("/a")))
        self.assertEqual(seen, [live.current])
        # until a restart, every reload names them again
        self.assertEqual(live.swap(parse_config('listen = "tcp:2"\n')).restart, ("listen", "data_dir"))

    def test_a_failing_subscriber_is_logged_and_the_others_run(self) -> None:
        from blazar.config import LiveConfig

        live = LiveConfig(Config())
        seen: list[Config] = []

        def broken(config: Config) -> None:
            raise RuntimeError("boom")

        live.subscribe(broken)
        live.subscribe(seen.append)
        live.swap(Config(max_body_bytes=5))
        self.assertEqual(len(seen), 1)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_live_config_wraps_a_plain_config_once(self) -> None:
        from blazar.config import LiveConfig, live_config

        live = LiveConfig(Config())
        self.assertIs(live_config(live), live)
        self.assertEqual(live_config(Config(keep_alive=1)).current.keep_alive, 1)


def test_sentinel_enforce_per_model_and_key() -> None:
    from blazar.config import parse_config

    config = parse_config(
        'sentinel_enforce = false\nsentinel_stall_secs = 5\n[models."m"]\nsentinel_enforce = true\n'
        '[[keys]]\nname = "k"\nsecret = "0123456789abcdef0123"\nsentinel_enforce = false\n'
    )
    assert config.models["m:latest"].sentinel_enforce is True
    assert config.keys[0].sentinel_enforce is False
    assert config.sentinel_stall == 5 and config.sentinel_enforce is False
    import pytest

    from blazar.config import ConfigError

    with pytest.raises(ConfigError, match="sentinel_enforce"):
        parse_config('[[keys]]\nname = "k"\nsecret = "0123456789abcdef0123"\nsentinel_enforce = 1\n')


def test_file_storage_quota_globally_and_per_key() -> None:
    from blazar.config import DEFAULT_FILE_BYTES_PER_KEY

    assert parse_config("").max_file_bytes_per_key == DEFAULT_FILE_BYTES_PER_KEY == 1 << 30
    config = parse_config(
        'max_file_bytes_per_key = 5000\n[[keys]]\nname = "k"\nsecret = "0123456789abcdef0123"\nfile_bytes = 7\n'
        '[[keys]]\nname = "j"\nsecret = "0123456789abcdef0124"\n'
    )
    assert (config.max_file_bytes_per_key, config.keys[0].file_bytes, config.keys[1].file_bytes) == (5000, 7, None)
    for text, key in [
        ("max_file_bytes_per_key = 0\n", "max_file_bytes_per_key"),
        ('max_file_bytes_per_key = "1G"\n', "max_file_bytes_per_key"),
        ('[[keys]]\nname = "k"\nsecret = "0123456789abcdef0123"\nfile_bytes = -1\n', "keys[0].file_bytes"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(repr(key))):
            parse_config(text)


class CacheConfigTests(SynchronousTestCase):
    """
    C{[cache]}: the semantic cache, off unless asked for, and per model and
    per key C{cache = true|false}.
    """

    SECRET = "0123456789abcdef0123"
    EMBED = '[models."e"]\nembedding = true\n'

    def test_defaults(self) -> None:
        from blazar.config import CacheConfig

        self.assertEqual(parse_config("").cache, CacheConfig())
        self.assertEqual(
            (
                CacheConfig().enabled,
                CacheConfig().embedding_model,
                CacheConfig().threshold,
                CacheConfig().ttl,
                CacheConfig().max_entries,
            ),
            (False, None, 0.90, 600.0, 10000),
        )
        self.assertIsNone(parse_config('[models."m"]\n').models["m:latest"].cache)

    def test_every_key(self) -> None:
        config = parse_config(
            '[cache]\nenabled = true\nembedding_model = "e"\nthreshold = 1\nttl_secs = 2.5\nmax_entries = 3\n'
            + self.EMBED
            + '[models."m"]\ncache = false\n'
            f'[[keys]]\nname = "k"\nsecret = "{self.SECRET}"\ncache = true\n'
        )
        cache = config.cache
        self.assertEqual(
            (cache.enabled, cache.embedding_model, cache.threshold, cache.ttl, cache.max_entries),
            (True, "e:latest", 1.0, 2.5, 3),
        )
        self.assertIs(config.models["m:latest"].cache, False)
        self.assertIs(config.keys[0].cache, True)

    def test_bad_values_name_the_key(self) -> None:
        for text, key in [
            ("[cache]\nthreshold = 0\n", "cache.threshold"),
            ("[cache]\nthreshold = 1.5\n", "cache.threshold"),
            ("[cache]\nthreshold = true\n", "cache.threshold"),
            ("[cache]\nttl_secs = 0\n", "cache.ttl_secs"),
            ("[cache]\nmax_entries = -1\n", "cache.max_entries"),
            ("[cache]\nenabled = 1\n", "cache.enabled"),
            ('[cache]\nembedding_model = ""\n', "cache.embedding_model"),
            ('[cache]\nembedding_model = "a b"\n', "cache.embedding_model"),
            ("[cache]\nsize = 3\n", "cache.size"),
            ('[models."m"]\ncache = "yes"\n', "models.m.cache"),
            (f'[[keys]]\nname = "k"\nsecret = "{self.SECRET}"\ncache = 0\n', "keys[0].cache"),
            ("cache = 1\n", "cache"),
        ]:
            with self.assertRaises(ConfigError, msg=text) as caught:
                parse_config(text)
            self.assertIn(repr(key), str(caught.exception), text)

    def test_enabled_anywhere_needs_an_embedding_model(self) -> None:
        for text in [
            "[cache]\nenabled = true\n",
            '[models."m"]\ncache = true\n',
            f'[[keys]]\nname = "k"\nsecret = "{self.SECRET}"\ncache = true\n',
        ]:
            with self.assertRaises(ConfigError, msg=text) as caught:
                parse_config(text)
            self.assertIn("'cache.embedding_model' is not set", str(caught.exception))
        # off everywhere (false is not a use): no embedding model needed
        parse_config('[cache]\nenabled = false\n[models."m"]\ncache = false\n')

    def test_the_embedding_model_must_serve_embeddings(self) -> None:
        for text in [
            '[cache]\nenabled = true\nembedding_model = "m"\n',
            '[cache]\nenabled = true\nembedding_model = "m"\n[models."m"]\nctx_size = 512\n',
        ]:
            with self.assertRaises(ConfigError) as caught:
                parse_config(text)
            self.assertIn('set embedding = true under [models."m:latest"]', str(caught.exception))
        parse_config('[cache]\nenabled = true\nembedding_model = "e"\n' + self.EMBED)

    def test_reload_names_each_cache_key(self) -> None:
        from blazar.config import config_changes

        old = parse_config("")
        new = parse_config("[cache]\nttl_secs = 5\nthreshold = 0.95\n")
        self.assertEqual(config_changes(old, new).applied, ("cache.threshold", "cache.ttl_secs"))


class ExposedSecretsTests(SynchronousTestCase):
    """
    A config file holding secrets that others may read is named, with the
    fix, at startup and by C{blazar doctor} (issue 36); its mode is left
    as the operator set it.
    """

    def write(self, text: str, mode: int) -> Path:
        path = Path(self.mktemp())
        path.write_text(text)
        path.chmod(mode)
        return path

    def test_readable_secrets_are_named_with_the_fix(self) -> None:
        from blazar.config import thd_exposed_secrets

        keys = '[[keys]]\nname = "me"\nsecret = "' + "s" * 16 + '"\n'
        remote = '[[remotes]]\nname = "peer"\nbase_url = "http://127.0.0.1:9/v1"\napi_key = "sk-x"\nmodels = ["a"]\n'
        path = self.write(keys + remote, 0o644)
        warning = thd_exposed_secrets(load_config(path))
        self.assertEqual(
            warning,
            f"config file {path} holds secrets ([[keys]] secret, [[remotes]] api_key) and "
            f"everyone may read it (mode 644): run `chmod 600 {path}`",
        )
        self.assertEqual(path.stat().st_mode & 0o777, 0o644)  # not changed behind the operator's back
        path.chmod(0o640)
        self.assertIn("its group may read it (mode 640)", thd_exposed_secrets(load_config(path)) or "")
        path.chmod(0o600)
        self.assertIsNone(thd_exposed_secrets(load_config(path)))
        for text in ("", remote.replace('api_key = "sk-x"', 'api_key_env = "PEER_KEY"')):
            self.assertIsNone(thd_exposed_secrets(load_config(self.write(text, 0o644))))
        self.assertIsNone(thd_exposed_secrets(parse_config(keys)))  # no file


def test_doctor_names_a_readable_config_with_secrets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from blazar.cli.doctor import doctor as _doctor

    config = tmp_path / "c.toml"
    config.write_text(
        f'data_dir = "{tmp_path / "data"}"\nmodels_dir = "{tmp_path}"\nengine_check_secs = 0\n'
        '[[keys]]\nname = "me"\nsecret = "' + "s" * 16 + '"\n'
    )
    config.chmod(0o644)
    assert _doctor(argparse.Namespace(config=str(config))) == 1
    out = capsys.readouterr().out
    assert (
        f"[FAIL] config file {config} holds secrets ([[keys]] secret) and everyone may read it (mode 644): "
        f"run `chmod 600 {config}`" in out
    ), out


def test_gate_max_slowdown_is_an_engines_setting_not_a_lane() -> None:
    from blazar.config import ConfigError, parse_config

    assert parse_config("").gate_max_slowdown == 0.0  # no speed check unless asked
    config = parse_config('[engines]\ngate_max_slowdown = 0.10\n[engines.vllm]\ncommand = ["v", "{port}"]\n')
    assert config.gate_max_slowdown == 0.10
    assert [lane.name for lane in config.lanes] == ["vllm"]
    for bad in ("1", "-0.1", "true", '"10%"', "nan"):
        with pytest.raises(ConfigError, match="engines.gate_max_slowdown.*a fraction from 0"):
            parse_config(f"[engines]\ngate_max_slowdown = {bad}\n")


class LoraConfigTests(SynchronousTestCase):
    """
    C{lora = [...]} under C{[models."name"]}: the adapters a model's
    child is started with (issue 39).
    """

    def test_paths_and_scales(self) -> None:
        c = parse_config(
            'models_dir = "/m"\n[models."a"]\n'
            'lora = ["style.gguf", {path = "/abs/b.gguf", scale = 0.5}, {path = "c.gguf"}]\n'
        )
        self.assertEqual(
            c.models["a:latest"].lora,
            ((Path("/m/style.gguf"), 1.0), (Path("/abs/b.gguf"), 0.5), (Path("/m/c.gguf"), 1.0)),
        )
        self.assertEqual(parse_config('[models."a"]\nctx_size = 1\n').models["a:latest"].lora, ())

    def test_bad_values_name_the_key(self) -> None:
        for text, said in [
            ('lora = "a.gguf"', "'models.a.lora' must be a list of LoRA adapter files"),
            ("lora = [1]", "'models.a.lora[0]' must be a list of LoRA adapter files"),
            ("lora = [{scale = 0.5}]", "models.a.lora[0] has no path"),
            ('lora = [{path = "a.gguf", scale = "half"}]', "'models.a.lora[0].scale' must be a number"),
            ('lora = [{path = "a.gguf", scale = true}]', "'models.a.lora[0].scale' must be a number"),
            ('lora = [{path = "a.gguf", weight = 1}]', "unknown key 'models.a.lora[0].weight'"),
            ('lora = [{path = "x:y.gguf", scale = 0.5}]', "holds a ':', which llama-server's --lora-scaled"),
        ]:
            with self.assertRaises(ConfigError) as cm:
                parse_config(f'[models."a"]\n{text}\n')
            self.assertIn(said, str(cm.exception), text)
        # a ':' is fine at scale 1 (--lora FILE)
        self.assertEqual(
            parse_config('models_dir = "/m"\n[models."a"]\nlora = ["x:y.gguf"]\n').models["a:latest"].lora,
            ((Path("/m/x:y.gguf"), 1.0),),
        )

    def test_a_reload_names_the_model_whose_adapters_changed(self) -> None:
        from blazar.config import config_changes

        old = parse_config('[models."a"]\nlora = ["x.gguf"]\n')
        new = parse_config('[models."a"]\nlora = [{path = "x.gguf", scale = 0.25}]\n')
        self.assertEqual(config_changes(old, new).applied, ('models."a:latest"',))
