from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from blazar.config import ModelConfig, parse_config
from blazar.engines.llamacpp import EngineNotFound, build_command, find_binary
from blazar.models.gguf_meta import GGUFMetadata
from blazar.models.registry import ModelEntry

META = GGUFMetadata("llama", 32768, 2, 64, 4, 4, 0, True, None, 1000)


def flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


class BuildCommandTests(SynchronousTestCase):
    def command(self, settings: ModelConfig = ModelConfig(), meta: GGUFMetadata = META, config_text: str = ""):  # type: ignore[no-untyped-def]
        entry = ModelEntry("m:latest", Path("/models/m.gguf"), settings=settings)
        return build_command(
            Path("/bin/llama-server"), entry, meta, port=4321, api_key="k3y",
            config=parse_config(config_text),
        )

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
            'cache_type_v = "q4_0"\nflash_attn = "on"\nthreads = 6\nn_cpu_moe = 2\nuse_mmap = false\n')
        argv = self.command(config.models["m:latest"]).argv
        self.assertEqual((flag(argv, "-ngl"), flag(argv, "--main-gpu"), flag(argv, "--tensor-split")),
                         ("20", "1", "3,1"))
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

        for bad in ('gpu_layers = -1', 'gpu_layers = "all"', 'tensor_split = []', 'tensor_split = [0, 0]',
                    'cache_type_k = "q3"', 'flash_attn = true', 'threads = 0', 'use_mmap = "no"'):
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
        config = parse_config("")
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
            find_binary(parse_config(""), env, which=lambda _: None, bundled=lambda: None)
        message = str(cm.exception)
        self.assertIn("scripts/build-engine.sh", message)
        self.assertIn("[engines.llamacpp] binary", message)
