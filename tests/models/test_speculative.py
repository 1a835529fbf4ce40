"""
The draft model's vocabulary check (L{blazar.models.speculative}) on
generated GGUFs.
"""

from pathlib import Path
from typing import Any

from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import ConfigError, parse_config, thd_rewrite
from blazar.models.gguf_meta import GGUFError
from blazar.models.registry import ModelEntry
from blazar.models.speculative import thd_check_drafts, thd_vocabulary
from blazar.models.testmodel import make_test_model
from blazar.protocols.keyadmin import thd_load_checked
from blazar.tap import Options


class VocabularyTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp()).resolve()
        self.dir.mkdir()

    def model(self, name: str, **kwargs: object) -> Path:
        return make_test_model(self.dir / name, **kwargs).path  # type: ignore[arg-type]

    def test_the_same_vocabulary_whatever_the_weights(self) -> None:
        a = thd_vocabulary(self.model("a.gguf", seed=1))
        b = thd_vocabulary(self.model("b.gguf", seed=2, n_layer=1))
        self.assertEqual(a, b)
        self.assertEqual(a.kind, "llama")
        self.assertGreater(a.size, 256)

    def test_more_tokens_or_other_tokens_differ(self) -> None:
        base = thd_vocabulary(self.model("a.gguf"))
        more = thd_vocabulary(self.model("b.gguf", extra_words=("zebra",)))
        other = thd_vocabulary(self.model("c.gguf", extra_words=("yak",)))
        self.assertEqual(more.size, base.size + 1)
        self.assertEqual(more.size, other.size)
        self.assertNotEqual(more.digest, other.digest)

    def test_a_file_cut_short_is_a_gguf_error_wherever_it_is_cut(self) -> None:
        """
        A GGUF still being copied (cut anywhere) is a L{GGUFError} naming
        the file, never the reader's own IndexError or struct.error.
        """
        data = self.model("whole.gguf").read_bytes()
        cut = self.dir / "cut.gguf"
        for size in range(8, min(len(data), 40000), 331):
            cut.write_bytes(data[:size])
            with self.subTest(size=size):
                error = self.assertRaises(GGUFError, thd_vocabulary, cut)
                self.assertIn("cut.gguf", str(error))


class CheckDraftsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp()).resolve()
        (self.dir / "models").mkdir(parents=True)
        make_test_model(self.dir / "models" / "big.gguf", seed=1)

    def config(self, draft: str, extra: str = "") -> str:
        return (
            f'data_dir = "{self.dir / "data"}"\nmodels_dir = "{self.dir / "models"}"\n'
            f'[models."big"]\nspeculative = "draft"\ndraft_model = "{draft}"\n{extra}'
        )

    def check(self, draft: str) -> None:
        thd_check_drafts(parse_config(self.config(draft)))

    def test_a_draft_of_the_same_vocabulary_by_name_or_path(self) -> None:
        make_test_model(self.dir / "models" / "small.gguf", seed=2, n_layer=1)
        self.check("small")
        self.check("small.gguf")
        self.check(str(self.dir / "models" / "small.gguf"))

    def test_a_draft_of_another_vocabulary_is_refused_with_the_fix(self) -> None:
        make_test_model(self.dir / "models" / "other.gguf", extra_words=("zebra", "yak"))
        e = self.assertRaises(ConfigError, self.check, "other")
        self.assertIn("[models.\"big:latest\"] draft_model = 'other'", str(e))
        self.assertIn("does not share the model's vocabulary", str(e))
        self.assertRegex(str(e), r"it has (\d+) tokens and the model has \d+")
        self.assertIn('speculative = "ngram"', str(e))

    def test_same_size_other_tokens_is_refused(self) -> None:
        make_test_model(self.dir / "models" / "big.gguf", seed=1, extra_words=("zebra",))
        make_test_model(self.dir / "models" / "other.gguf", extra_words=("yak",))
        e = self.assertRaises(ConfigError, self.check, "other")
        self.assertIn("not the same ones", str(e))

    def test_a_missing_draft_is_refused(self) -> None:
        e = self.assertRaises(ConfigError, self.check, "nowhere")
        self.assertIn("the draft model's file ", str(e))
        self.assertIn("cannot be read", str(e))
        self.assertIn("name a model `blazar models list` shows or a GGUF path", str(e))
        self.assertIn(str(self.dir / "models" / "nowhere"), str(e))  # the path it tried

    def test_a_key_change_written_to_the_file_checks_it_too(self) -> None:
        """
        A runtime key change rewrites the whole file (L{thd_rewrite}): a
        draft model hand-edited in since the last load is refused there as
        at load, and the file is left as it was.
        """
        make_test_model(self.dir / "models" / "other.gguf", extra_words=("zebra",))
        path = self.dir / "config.toml"
        path.write_text(self.config("other"))

        def add(doc: Any) -> None:
            doc["keys"] = {"team": "blz-team-secret-0123456789"}

        self.assertRaises(ConfigError, thd_rewrite, path, add, thd_check_drafts)
        self.assertEqual(path.read_text(), self.config("other"))

    def test_nothing_is_read_without_a_draft_model(self) -> None:
        def scan(*args: object) -> dict[str, ModelEntry]:
            raise AssertionError("scanned")

        thd_check_drafts(parse_config('[models."m"]\nspeculative = "ngram"\n'), scan=scan)

    def test_startup_and_reload_refuse_it(self) -> None:
        """
        twistd's option parsing (startup) and C{blazar reload}'s loader
        both run the check.
        """
        make_test_model(self.dir / "models" / "other.gguf", extra_words=("zebra",))
        path = self.dir / "config.toml"
        path.write_text(self.config("other"))
        e = self.assertRaises(usage.UsageError, Options().parseOptions, ["--config", str(path)])
        self.assertIn("does not share the model's vocabulary", str(e))
        self.assertRaises(ConfigError, thd_load_checked, path)
        make_test_model(self.dir / "models" / "other.gguf", seed=3)
        self.assertEqual(thd_load_checked(path).models["big:latest"].speculative, "draft")
