"""
C{blazar serve} with a config it cannot use: the error alone, as the
CLI's other verbs print theirs, not under twistd's usage block (which
reads as a command-line mistake).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from blazar.cli.daemon import ERROR
from blazar.cli.serve import _serve


def test_a_bad_config_is_named_without_twistds_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[models."m"]\nparallel = "many"\n')
    assert _serve(argparse.Namespace(config=str(config))) == ERROR
    captured = capsys.readouterr()
    assert captured.err.startswith("blazar serve: ") and "parallel" in captured.err, captured.err
    assert "Usage:" not in captured.out + captured.err and "twistd" not in captured.out + captured.err
