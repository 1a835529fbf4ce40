"""
Run files: while a child lives, C{<data_dir>/run/<model>.pid} (JSON: pid,
model, port, argv) and C{<model>.apikey}, both mode 0600 in a 0700
directory, describe it, so that a daemon that died without stopping its
children can find and stop them on its next start.

Functions here block (files, psutil): call them in a thread pool, or at
startup before the reactor serves.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import psutil

from blazar import strictjson
from blazar.files import open_private, private_dir


def run_dir(data_dir: Path) -> Path:
    """
    C{<data_dir>/run}, created (or set) with mode 0700.
    """
    path = data_dir / "run"
    private_dir(path)
    return path


def _stem(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", model)


def thd_write(run: Path, model: str, pid: int, port: int, argv: list[str], api_key: str) -> None:
    """
    Record a live child.
    """
    stem = _stem(model)
    info = {"pid": pid, "model": model, "port": port, "argv": argv}
    tmp = run / f".{stem}.pid.tmp"
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_TRUNC), "w") as f:
        f.write(strictjson.encode(info))
    os.replace(tmp, run / f"{stem}.pid")
    with os.fdopen(open_private(run / f"{stem}.apikey", os.O_WRONLY | os.O_TRUNC), "w") as f:
        f.write(api_key)


def thd_remove(run: Path, model: str, pid: int) -> None:
    """
    Forget a child that exited (only if the files still describe C{pid}).
    """
    stem = _stem(model)
    try:
        info = json.loads((run / f"{stem}.pid").read_text())
    except (OSError, ValueError):
        info = {}
    if info.get("pid") not in (None, pid):
        return
    for suffix in (".pid", ".apikey"):
        try:
            (run / f"{stem}{suffix}").unlink()
        except FileNotFoundError:
            pass


def _matches(proc: psutil.Process, info: dict[str, Any]) -> bool:
    try:
        cmdline = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    # after the launcher's exec, the engine's command line is the recorded argv
    return bool(cmdline) and cmdline == info.get("argv")


def thd_stop_orphans(run: Path, grace: float = 5.0) -> list[int]:
    """
    Stop every child recorded in C{run} that is still running with the
    recorded command line (a pid reused by another program is left alone),
    and clear all run files.

    @return: The pids that were stopped.
    """
    stopped = []
    for pid_file in sorted(run.glob("*.pid")):
        try:
            info = json.loads(pid_file.read_text())
            pid = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            info, pid = {}, 0
        if pid > 0:
            try:
                proc = psutil.Process(pid)
            except psutil.NoSuchProcess:
                proc = None
            if proc is not None and _matches(proc, info):
                try:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(grace)
                    except psutil.TimeoutExpired:
                        proc.kill()
                        proc.wait(grace)
                    stopped.append(pid)
                except psutil.NoSuchProcess:
                    pass
        for path in (pid_file, pid_file.with_suffix(".apikey")):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
    return stopped
