"""
The test model generator is a product module (C{blazar models make-test}),
not part of the test helpers.
"""

import ast
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

import blazar
import blazar.testing
from blazar.models.gguf_meta import thd_read_metadata
from blazar.models.testmodel import STRICT_CHAT_TEMPLATE, make_test_model, vocabulary

PACKAGE = Path(blazar.__file__).parent


class TestModelTests(SynchronousTestCase):
    def test_writes_a_readable_gguf(self) -> None:
        model = make_test_model(Path(self.mktemp()) / "m.gguf", chat_template=STRICT_CHAT_TEMPLATE)
        meta = thd_read_metadata(model.path, ())
        self.assertEqual(meta.context_length, 2048)
        self.assertEqual(meta.chat_template, STRICT_CHAT_TEMPLATE)
        self.assertEqual(model.token_ids["<tool_call>"], vocabulary()[0].index("<tool_call>"))

    def test_not_in_the_testing_module(self) -> None:
        for name in ("make_test_model", "GeneratedModel", "CHAT_TEMPLATE", "STRICT_CHAT_TEMPLATE", "vocabulary"):
            self.assertFalse(hasattr(blazar.testing, name), name)

    def test_product_code_never_imports_the_testing_module(self) -> None:
        offenders = []
        for path in PACKAGE.rglob("*.py"):
            if path.name == "testing.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else ([a.name for a in node.names] if isinstance(node, ast.Import) else [])
                )
                offenders += [str(path.relative_to(PACKAGE)) for n in names if n == "blazar.testing"]
        self.assertEqual(offenders, [])


class MakeTestVerbTests(SynchronousTestCase):
    """
    C{blazar models make-test} takes the generator's shape options, so a
    user trying a coding agent gets a 128k-context model without Python.
    """

    def test_shape_options(self) -> None:
        from blazar.cli import main

        path = Path(self.mktemp()) / "long.gguf"
        self.assertEqual(
            main(
                [
                    "models",
                    "make-test",
                    str(path),
                    "--ctx",
                    "131072",
                    "--embd",
                    "128",
                    "--heads",
                    "8",
                    "--layers",
                    "3",
                    "--template",
                    "thinking",
                ]
            ),
            0,
        )
        meta = thd_read_metadata(path, ())
        self.assertEqual(
            (meta.context_length, meta.embedding_length, meta.head_count, meta.block_count), (131072, 128, 8, 3)
        )
        self.assertIn("<think>", meta.chat_template or "")

    def test_a_shape_the_generator_cannot_make_is_refused(self) -> None:
        from blazar.cli import main

        self.assertEqual(
            main(["models", "make-test", str(Path(self.mktemp()) / "x.gguf"), "--embd", "60", "--heads", "8"]), 2
        )
