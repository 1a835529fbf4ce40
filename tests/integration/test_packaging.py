"""
A normal (non-editable) install ships the twistd plugin: `twistd --help`
lists `blazar`, and the `blazar` console script runs.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_install_registers_twistd_plugin(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        check=True, timeout=300,
    )
    (wheel,) = wheels.glob("blazar-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )
    # Install the wheel for real with the new venv's own pip (pip --prefix
    # from this venv would uninstall this venv's editable blazar), but borrow
    # this venv's dependencies: a .pth line adds a path without running that
    # path's own .pth files, so the editable checkout is NOT on the new path.
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)],
        check=True, timeout=300,
    )
    (purelib / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    assert (purelib / "twisted" / "plugins" / "blazar_plugin.py").is_file()

    empty = tmp_path / "cwd"
    empty.mkdir()
    probe = subprocess.run(
        [str(python), "-c", "import blazar; print(blazar.__file__)"],
        check=True, capture_output=True, text=True, cwd=empty,
    )
    assert probe.stdout.startswith(str(purelib)), probe.stdout

    result = subprocess.run(
        [str(python), "-m", "twisted", "twistd", "--help"],
        capture_output=True, text=True, cwd=empty, timeout=120,
    )
    # `--help` exits 64 (EX_USAGE) after printing; the listing is what counts
    commands = (result.stdout + result.stderr).split("Commands:", 1)[1]
    assert any(line.split()[:1] == ["blazar"] for line in commands.splitlines()), commands

    cli = subprocess.run(
        [str(venv / "bin" / "blazar"), "--help"], capture_output=True, text=True, cwd=empty,
    )
    assert cli.returncode == 0 and "serve" in cli.stdout, cli.stderr


