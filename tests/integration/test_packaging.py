"""
A normal (non-editable) install runs the daemon: the built wheel, installed
with its dependencies into a fresh venv, ships every subpackage and the twistd
plugin stub (and nothing that shadows Twisted), `twistd --help` lists
`blazar`, the `blazar` console script runs, and `twistd -n blazar` started
from that venv in an empty directory serves a chat completion from a real
llama-server child.

The wheel is installed for real, dependencies included, with the new venv's
own pip (from PyPI or the configured indexes, about 30 s): borrowing this
venv's site-packages would hide a dependency that is missing from
pyproject.toml, which is the same class of fault as a missing package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Iterator

import attrs
import pytest

from blazar.models.testmodel import GeneratedModel
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon

ROOT = Path(__file__).resolve().parents[2]


@attrs.frozen
class Installed:
    """
    A fresh venv with the wheel installed in it.

    @ivar wheel: The wheel file that was installed.
    @ivar bin: The venv's C{bin} directory.
    @ivar purelib: The venv's site-packages.
    @ivar empty: An empty directory to run commands in, outside the checkout.
    @ivar env: The environment for those commands: this one without
        C{PYTHONPATH} or C{BLAZAR_*}, so nothing but the venv is importable.
    """

    wheel: Path
    bin: Path
    purelib: Path
    empty: Path
    env: dict[str, str]

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / argv[0]), *argv[1:]],
            capture_output=True,
            text=True,
            cwd=self.empty,
            env=self.env,
            timeout=timeout,
        )


def source_copy(dest: Path) -> Path:
    """
    Copy the checkout's files (tracked and untracked, not ignored) to C{dest}:
    building in place would write C{build/} and C{*.egg-info} into a shared
    tree, and a stale C{build/lib} there ends up in the wheel.
    """
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():  # a tracked file may be deleted in the work tree
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("packaging")
    src = source_copy(tmp / "src")
    wheels = tmp / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(src)],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("blazar-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    # the new venv's own pip: pip --prefix from this venv would uninstall this
    # venv's editable blazar
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    empty = tmp / "cwd"
    empty.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP") and not k.startswith("BLAZAR_")
    }
    return Installed(wheel, venv / "bin", purelib, empty, env)


def test_wheel_ships_every_package_and_no_twisted_init(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as whl:
        names = set(whl.namelist())
    shipped = {n for n in names if n.endswith(".py")}
    on_disk = {
        p.relative_to(ROOT).as_posix()
        for top in ("blazar", "twisted")
        for p in (ROOT / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert on_disk - shipped == set(), "modules left out of the wheel"
    assets = {p.relative_to(ROOT).as_posix() for p in (ROOT / "blazar" / "web" / "ui").iterdir() if p.is_file()}
    assert assets and assets <= names, ("the dashboard's assets left out of the wheel", assets - names)
    assert "twisted/plugins/blazar_plugin.py" in shipped
    # an __init__.py here would shadow the real Twisted (or its plugins package)
    assert {n for n in names if n.startswith("twisted/")} == {"twisted/plugins/blazar_plugin.py"}
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"blazar", "twisted"}, tops


def test_installed_imports_come_from_the_venv(installed: Installed) -> None:
    probe = installed.run(
        "python",
        "-c",
        "import sys, blazar.tap, blazar.web.translate.responses, twisted, twisted.plugins.blazar_plugin as p\n"
        "print(blazar.tap.__file__); print(p.__file__); print(twisted.__file__)\n"
        "print(repr(sys.path))",
    )
    assert probe.returncode == 0, probe.stderr
    tap, plugin, twisted_init, path = probe.stdout.splitlines()
    site = str(installed.purelib) + os.sep
    assert tap.startswith(site) and plugin.startswith(site), probe.stdout
    # the real Twisted, not a namespace shell made of our plugins directory
    assert twisted_init == os.path.join(installed.purelib, "twisted", "__init__.py")
    assert str(ROOT) not in path, path


def test_twistd_lists_the_plugin(installed: Installed) -> None:
    result = installed.run("twistd", "--help")
    # `--help` exits 64 (EX_USAGE) after printing; the listing is what counts
    commands = (result.stdout + result.stderr).split("Commands:", 1)[1]
    assert any(line.split()[:1] == ["blazar"] for line in commands.splitlines()), commands
    plugin_help = installed.run("twistd", "blazar", "--help")
    assert plugin_help.returncode == 0 and "--config" in plugin_help.stdout, plugin_help.stdout + plugin_help.stderr


def test_console_script_runs(installed: Installed) -> None:
    cli = installed.run("blazar", "--help")
    assert cli.returncode == 0 and "serve" in cli.stdout, cli.stderr


class InstalledDaemon(Daemon):
    """
    L{Daemon}, but run by the installed venv's C{twistd} in its empty
    directory with its environment.
    """

    def __init__(self, installed: Installed, root: Path, config_text: str) -> None:
        super().__init__(root, config_text)
        self.installed = installed

    def command(self) -> list[str]:
        return [
            str(self.installed.bin / "twistd"),
            "--nodaemon",
            "--pidfile=",
            "blazar",
            "--config",
            str(self.config),
        ]

    def start(self, wait: bool = True) -> "InstalledDaemon":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.installed.empty,
                env=self.installed.env,
            )
        if wait:
            self.wait_healthy()
        return self


@pytest.fixture
def installed_daemon(
    installed: Installed,
    engine: str,
    models: dict[str, GeneratedModel],
    tmp_path: Path,
) -> Iterator[InstalledDaemon]:
    d = InstalledDaemon(installed, tmp_path / "daemon", daemon_config(engine, models))
    try:
        d.start()
    except BaseException:
        d.kill_everything()
        raise
    try:
        yield d
    finally:
        d.close()


def test_installed_daemon_serves_a_chat_completion(installed_daemon: InstalledDaemon) -> None:
    status, body = installed_daemon.post_json(
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "seed": 1,
        },
    )
    assert status == 200, (body, installed_daemon.log()[-3000:])
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str), body
    assert os.listdir(installed_daemon.installed.empty) == []


def test_installed_daemon_serves_the_dashboard(installed_daemon: InstalledDaemon) -> None:
    status, headers, page = installed_daemon.request("GET", "/ui")
    assert status == 200 and b'<script src="/ui/static/app.js"' in page, page[:300]
    assert "script-src 'self'" in headers["content-security-policy"] and headers["x-frame-options"] == "DENY"
    for asset in ("app.js", "app.css"):
        status, _, body = installed_daemon.request("GET", f"/ui/static/{asset}")
        assert status == 200 and len(body) > 1000, asset
