"""
docs/config-reference.md is written from the config keys' declarations
(L{blazar.config.reference}); it must say what the code does.
"""

from pathlib import Path

import attrs
import pytest

from blazar.config import CacheConfig, CommandLane, Config, KeyConfig, LlamaCppConfig, ModelConfig, QueueConfig, \
    RemoteConfig
from blazar.config.declare import declared
from blazar.config.reference import REGENERATE, main, markdown

REFERENCE = Path(__file__).parent.parent / "docs" / "config-reference.md"


def test_the_committed_reference_is_what_the_declarations_say() -> None:
    assert REFERENCE.read_text(encoding="utf-8") == markdown(), (
        f"{REFERENCE} differs from the config keys' declarations: run `{REGENERATE}` and commit it")


@pytest.mark.parametrize("cls", [Config, QueueConfig, CacheConfig, LlamaCppConfig, CommandLane, ModelConfig, KeyConfig,
                                 RemoteConfig])
def test_every_key_is_declared_with_its_doc(cls: type) -> None:
    names = {field.name for field, _ in declared(cls)}
    # a lane's name is its table's ([engines.NAME]), not a key
    assert names == {field.name for field in attrs.fields(cls)} - ({"name"} if cls is CommandLane else set())
    reference = markdown()
    for field, key in declared(cls):
        assert key.doc, (cls, field.name)
        if key.in_file and key.value is not None and not attrs.has(type(field.default)):
            assert f"| `{key.name.split('.')[-1]}` |" in reference, key.name


def test_python_m_blazar_config_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--reference"]) == 0
    assert capsys.readouterr().out == markdown()
    assert main([]) == 2
    assert REGENERATE in capsys.readouterr().out
