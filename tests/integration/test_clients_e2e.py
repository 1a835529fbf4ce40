"""
The coding agents' conformance run in the suite: `scripts/clients.py` (what
`./dev.sh clients` runs) drives the pinned Claude Code and Codex CLI npm
releases through a real daemon with API keys on and a generated 128k-context
model, two turns each, and every run must exit 0 having been served by Blazar.

It needs npm (the agents are installed once into ~/.cache/blazar/clients) and
takes a few minutes: Claude Code's first request is a long prefill on CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TURNS = [("claude-code", 1), ("claude-code", 2), ("codex", 1), ("codex", 2)]


def test_coding_agents_work_through_blazar(engine: str, tmp_path: Path) -> None:
    out = tmp_path / "clients.json"
    try:
        done = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "clients.py"), "--engine", engine, "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=3600,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the conformance run took over an hour:\n{e.stdout!r}\n{e.stderr!r}")
    report = f"{done.stdout[-8000:]}\n{done.stderr[-6000:]}"
    assert out.exists(), f"no results written (exit {done.returncode}):\n{report}"
    runs = json.loads(out.read_text())["runs"]
    assert [(r["client"], r["turn"]) for r in runs] == TURNS, report
    failed = [
        f"{r['client']} turn {r['turn']}: exit {r['exit_code']}, requests {r['requests']}"
        for r in runs
        if not r["passed"]
    ]
    assert failed == [] and done.returncode == 0, "\n".join(failed) + "\n" + report
    for r in runs:
        assert r["exit_code"] == 0 and r["requests_seen"] >= 1, r
