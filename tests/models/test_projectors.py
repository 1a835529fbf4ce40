"""
Vision projectors: which C{*mmproj*.gguf} serves which model
(L{blazar.models.registry.pair_projectors}, L{thd_scan}), the config's
C{mmproj}, and the tiny projector generator.
"""

import os
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from blazar.config import ConfigError, parse_config
from blazar.models.registry import is_projector_name, pair_projectors, thd_scan
from blazar.models.testprojector import image_tokens, make_test_projector


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


def never(_: Path) -> bool:
    return False


class PairTests(SynchronousTestCase):
    def test_a_projector_that_names_its_model(self) -> None:
        d = Path("/m")
        models = [d / "gemma-3-4b-it-Q4_K_M.gguf", d / "qwen2.5-vl-7b-Q8_0.gguf", d / "tiny.gguf", d / "tiny2.gguf"]
        projectors = [d / "mmproj-gemma-3-4b-it-f16.gguf", d / "Qwen2.5-VL-7B-mmproj-F16.gguf", d / "tiny.mmproj.gguf"]
        self.assertEqual(
            pair_projectors(models, projectors, never),
            {
                d / "gemma-3-4b-it-Q4_K_M.gguf": d / "mmproj-gemma-3-4b-it-f16.gguf",
                d / "qwen2.5-vl-7b-Q8_0.gguf": d / "Qwen2.5-VL-7B-mmproj-F16.gguf",
                d / "tiny.gguf": d / "tiny.mmproj.gguf",  # and not tiny2: a name matches up to a "-"
            },
        )

    def test_the_longest_name_wins(self) -> None:
        d = Path("/m")
        models = [d / "x-vl-Q4_0.gguf", d / "x-Q4_0.gguf"]
        projectors = [d / "mmproj-x.gguf", d / "mmproj-x-vl.gguf"]
        self.assertEqual(
            pair_projectors(models, projectors, never),
            {d / "x-vl-Q4_0.gguf": d / "mmproj-x-vl.gguf", d / "x-Q4_0.gguf": d / "mmproj-x.gguf"},
        )

    def test_a_generic_name_serves_a_folders_only_model_or_a_shared_folder(self) -> None:
        alone, flat, repo = Path("/a"), Path("/flat"), Path("/hf.co/u/r")
        models = [alone / "only.gguf", flat / "one.gguf", flat / "two.gguf", repo / "Q4_K_M.gguf", repo / "Q8_0.gguf"]
        projectors = [
            alone / "mmproj-F16.gguf",
            flat / "mmproj-model-f16.gguf",
            repo / "mmproj-BF16.gguf",
            repo / "mmproj-F16.gguf",
        ]
        pairs = pair_projectors(models, projectors, lambda folder: folder == repo)
        self.assertEqual(
            pairs,
            {
                alone / "only.gguf": alone / "mmproj-F16.gguf",
                # each of a pulled repository's quantizations: its first projector by name
                repo / "Q4_K_M.gguf": repo / "mmproj-BF16.gguf",
                repo / "Q8_0.gguf": repo / "mmproj-BF16.gguf",
            },
        )  # and in a folder of two models, a name that names neither serves neither

    def test_a_projector_elsewhere_serves_nothing(self) -> None:
        self.assertEqual(pair_projectors([Path("/a/m.gguf")], [Path("/b/mmproj-m.gguf")], never), {})

    def test_projector_names(self) -> None:
        self.assertTrue(is_projector_name("mmproj-x-f16.gguf"))
        self.assertTrue(is_projector_name("Qwen2-VL-MMPROJ.gguf"))
        self.assertFalse(is_projector_name("mmproj-notes.txt"))
        self.assertFalse(is_projector_name("model.gguf"))


class ScanTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp()).absolute()
        self.dir.mkdir()

    def test_a_projector_is_no_model_and_is_its_models(self) -> None:
        touch(self.dir / "seer.gguf")
        touch(self.dir / "mmproj-seer-f16.gguf")
        touch(self.dir / "plain.gguf")
        found = thd_scan(self.dir, {})
        self.assertEqual(sorted(found), ["plain:latest", "seer:latest"])
        self.assertEqual(found["seer:latest"].projector, self.dir / "mmproj-seer-f16.gguf")
        self.assertIsNone(found["plain:latest"].projector)

    def test_a_split_model_by_its_first_shard(self) -> None:
        for i in (1, 2):
            touch(self.dir / "big" / f"big-0000{i}-of-00002.gguf")
        touch(self.dir / "big" / "mmproj-big.gguf")
        touch(self.dir / "big" / "other.gguf")
        found = thd_scan(self.dir, {})
        self.assertEqual(found["big:latest"].projector, self.dir / "big" / "mmproj-big.gguf")
        self.assertIsNone(found["other:latest"].projector)

    def test_a_pulled_repositorys_projector(self) -> None:
        repo = self.dir / "hf.co" / "u" / "r"
        touch(repo / "Q4_K_M.gguf")
        touch(repo / "Q8_0.gguf")
        touch(repo / "mmproj-F16.gguf")
        found = thd_scan(self.dir, {})
        self.assertEqual(
            {e.name: e.projector for e in found.values()},
            {"hf.co/u/r:Q4_K_M": repo / "mmproj-F16.gguf", "hf.co/u/r:Q8_0": repo / "mmproj-F16.gguf"},
        )

    def test_an_alias_has_its_originals_projector(self) -> None:
        touch(self.dir / "seer.gguf")
        touch(self.dir / "mmproj-seer.gguf")
        touch(self.dir / "plain.gguf")
        os.link(self.dir / "seer.gguf", self.dir / "glasses:v1.gguf")  # as /api/copy writes it
        found = thd_scan(self.dir, {})
        self.assertEqual(found["glasses:v1"].projector, self.dir / "mmproj-seer.gguf")
        self.assertIsNone(found["plain:latest"].projector)

    def test_the_configs_mmproj_wins(self) -> None:
        touch(self.dir / "seer.gguf")
        touch(self.dir / "mmproj-seer.gguf")
        touch(self.dir / "a.gguf")
        touch(self.dir / "elsewhere" / "vision.gguf")
        config = parse_config(
            f'models_dir = "{self.dir}"\n'
            '[models.seer]\nmmproj = "elsewhere/vision.gguf"\n'
            '[models.a]\nmmproj = "/abs/p.gguf"\n'
        )
        found = thd_scan(self.dir, config.models)
        self.assertEqual(found["seer:latest"].projector, self.dir / "elsewhere" / "vision.gguf")
        self.assertEqual(found["a:latest"].projector, Path("/abs/p.gguf"))

    def test_a_configured_path_finds_the_projector_beside_it(self) -> None:
        outside = Path(self.mktemp()).absolute()
        touch(outside / "big-vl.gguf")
        touch(outside / "mmproj-big-vl-f16.gguf")
        config = parse_config(f'models_dir = "{self.dir}"\n[models."vl:7b"]\npath = "{outside / "big-vl.gguf"}"\n')
        found = thd_scan(self.dir, config.models)
        self.assertEqual(found["vl:7b"].projector, outside / "mmproj-big-vl-f16.gguf")

    def test_mmproj_must_be_a_path(self) -> None:
        with self.assertRaises(ConfigError) as e:
            parse_config("[models.x]\nmmproj = 3\n")
        self.assertIn("models.x.mmproj", str(e.exception))


class GeneratorTests(SynchronousTestCase):
    def test_a_clip_projector_for_the_test_model(self) -> None:
        from gguf import GGUFReader

        path = make_test_projector(Path(self.mktemp()) / "mmproj-t.gguf", text_embd=96)
        reader = GGUFReader(os.fspath(path))
        self.assertEqual(reader.fields["general.architecture"].contents(), "clip")
        self.assertEqual(reader.fields["clip.projector_type"].contents(), "mlp")
        tensors = {t.name: t for t in reader.tensors}
        # the MLP's output is the text model's width (llama.cpp refuses another)
        self.assertEqual(list(tensors["mm.2.weight"].shape), [64, 96])
        self.assertEqual(image_tokens(), 16)
        self.assertFalse(path.with_name(path.name + ".tmp").exists())
