"""
docs/config-reference.md is written from the config keys' declarations
(L{blazar.config.reference}); it must say what the code does.
"""

from pathlib import Path

import attrs
import pytest

from blazar.config import (
    CacheConfig,
    ClusterConfig,
    CommandLane,
    Config,
    KeyConfig,
    LlamaCppConfig,
    ModelConfig,
    QueueConfig,
    RemoteConfig,
)
from blazar.config.declare import declared
from blazar.config.reference import REGENERATE, main, markdown

REFERENCE = Path(__file__).parent.parent / "docs" / "config-reference.md"


def test_the_committed_reference_is_what_the_declarations_say() -> None:
    assert REFERENCE.read_text(encoding="utf-8") == markdown(), (
        f"{REFERENCE} differs from the config keys' declarations: run `{REGENERATE}` and commit it"
    )


@pytest.mark.parametrize(
    "cls",
    [
        Config,
        QueueConfig,
        CacheConfig,
        ClusterConfig,
        LlamaCppConfig,
        CommandLane,
        ModelConfig,
        KeyConfig,
        RemoteConfig,
    ],
)
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


def _wrong_type_cases() -> list[tuple[str, str]]:
    """
    For every declared key, a file setting it to a table (no key takes
    one) and the key's full name, which the refusal must name.
    """
    secret = "0123456789abcdef"
    tables: list[tuple[type, str, str, str]] = [
        (QueueConfig, "[queue]\n", "queue.", ""),
        (CacheConfig, "[cache]\n", "cache.", ""),
        (ClusterConfig, "[cluster]\n", "cluster.", ""),
        (LlamaCppConfig, "[engines.whisper]\n", "engines.whisper.", ""),
        (CommandLane, '[engines.vllm]\ncommand = ["v", "{port}"]\n', "engines.vllm.", "command"),
        (ModelConfig, '[models."a"]\n', "models.a.", "engine"),  # any engine name: a lane is looked up after
        (KeyConfig, f'[[keys]]\nname = "k"\nsecret = "{secret}"\n', "keys[0].", "name secret"),
        (RemoteConfig, '[[remotes]]\nname = "r"\nbase_url = "http://h/v1"\n', "remotes[0].", "name base_url"),
    ]
    cases = [
        (
            f"{key.name.split('.')[-1]} = {{}}\n"
            if "." not in key.name
            else f"[{key.name.split('.')[0]}]\n{key.name.split('.')[1]} = 1.5\n",
            key.name,
        )
        for field, key in declared(Config)
        if key.in_file and key.value is not None and not attrs.has(type(field.default))
    ]
    for cls, head, prefix, skip in tables:
        cases += [
            (f"{head}{key.name} = {{}}\n", prefix + key.name)
            for _, key in declared(cls)
            if key.value is not None and key.name not in skip.split()
        ]
    return cases


@pytest.mark.parametrize("text,key", _wrong_type_cases())
def test_every_declared_key_is_checked_and_named(text: str, key: str) -> None:
    from blazar.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as caught:
        parse_config(text, Path("/etc/b.toml"))
    assert str(caught.value).startswith("/etc/b.toml: ") and key in str(caught.value)
