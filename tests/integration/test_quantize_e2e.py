"""
Quantize through the engine's own llama-quantize (issue 39), for real: the
build lane put it beside the llama-server under test; C{blazar models
quantize} runs it (L{blazar.models.quantize.quantize}, no daemon), and the
model it wrote loads in the real llama-server and answers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from blazar.models.testmodel import make_test_model
from tests.integration.harness import Daemon, real_model


@pytest.fixture(scope="module")
def quantize_binary(engine: str) -> Path:
    """
    The llama-quantize beside the engine under test. Missing is a failure,
    never a skip: the build lane builds both.
    """
    binary = Path(engine).resolve().with_name("llama-quantize")
    if not binary.is_file():
        pytest.fail(
            f"no llama-quantize beside {engine}: rebuild the engine with the build lane "
            "(python -m blazar.engines.build), which builds both"
        )
    return binary


def quantize(root: Path, engine: str, *args: str) -> subprocess.CompletedProcess[str]:
    config = root / "quantize.toml"
    config.write_text(f'data_dir = "{root / "data"}"\n[engines.llamacpp]\nbinary = "{engine}"\n')
    return subprocess.run(
        [str(Path(sys.executable).parent / "blazar"), "models", "quantize", *args, "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=600,
    )


def tensor_types(path: Path) -> tuple[int | None, set[str]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.file_type")
    return (field.contents() if field else None), {t.tensor_type.name for t in reader.tensors}


def test_a_quantized_model_loads_and_answers(engine: str, quantize_binary: Path, tmp_path: Path) -> None:
    models = tmp_path / "models"
    # 256 wide: the k-quants' blocks (q4_K: 256 values) fit its rows
    make_test_model(models / "tiny-f32.gguf", n_embd=256, n_head=4, n_ff=512)
    done = quantize(tmp_path, engine, str(models / "tiny-f32.gguf"), "Q8_0")
    assert done.returncode == 0, done.stderr
    q8 = models / "tiny-q8_0.gguf"
    assert done.stdout.strip() == str(q8)
    assert "quantizing tiny-f32.gguf to q8_0" in done.stderr and "21/21 tensors" in done.stderr, done.stderr
    file_type, types = tensor_types(q8)
    assert file_type == 7 and "Q8_0" in types, (file_type, types)  # LLAMA_FTYPE_MOSTLY_Q8_0
    done = quantize(tmp_path, engine, str(models / "tiny-f32.gguf"), "q4_k_m", "--out", str(models / "k.gguf"))
    assert done.returncode == 0, done.stderr
    file_type, types = tensor_types(models / "k.gguf")
    assert file_type == 15 and "Q4_K" in types, (file_type, types)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert sorted(p.name for p in models.iterdir()) == ["k.gguf", "tiny-f32.gguf", "tiny-q8_0.gguf"]  # no leftovers

    d = Daemon(
        tmp_path / "daemon",
        (
            f'models_dir = "{models}"\nready_timeout = 60\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
            '[models."tiny-q8_0"]\nparallel = 1\n[models."k"]\nparallel = 1\n'
        ),
    )
    d.start()
    try:
        for name in ("tiny-q8_0", "k"):
            status, reply = d.post_json(
                "/v1/chat/completions",
                {"model": name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3},
            )
            assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply
        status, tags = d.post_json("/api/show", {"model": "tiny-q8_0"})
        assert status == 200 and tags["details"]["quantization_level"] == "Q8_0", tags
    finally:
        d.close(check_engines=True)


def test_what_cannot_be_quantized_is_refused_and_leaves_nothing(
    engine: str, quantize_binary: Path, tmp_path: Path
) -> None:
    """
    The real SmolLM2 is already quantized (Q4_1): quantizing it again is
    refused before llama-quantize runs; an unknown type too; a file that is
    not GGUF, and one llama-quantize gives up on, are refused in Blazar's or
    llama-quantize's own words, with no output left.
    """
    smol = real_model()
    done = quantize(tmp_path, engine, str(smol), "q8_0", "--out", str(tmp_path / "smol-q8_0.gguf"))
    assert done.returncode == 1 and "is already quantized (q4_1)" in done.stderr, done.stderr
    done = quantize(tmp_path, engine, str(smol), "q4_K_X", "--out", str(tmp_path / "x.gguf"))
    assert done.returncode == 1 and "unknown quantization type 'q4_K_X'" in done.stderr, done.stderr
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    done = quantize(tmp_path, engine, str(broken), "q8_0")
    assert done.returncode == 1 and "not a GGUF model" in done.stderr, done.stderr
    # llama-quantize itself gives up (an architecture it does not know): its words, and no file
    make_test_model(tmp_path / "odd.gguf", architecture="nonesuch")
    done = quantize(tmp_path, engine, str(tmp_path / "odd.gguf"), "q8_0")
    assert done.returncode == 1 and "llama-quantize could not quantize odd.gguf to q8_0 (exit 1): " in done.stderr, (
        done.stderr
    )
    assert "nonesuch" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.glob("*gguf*")) == ["broken.gguf", "odd.gguf"]
    assert not list(tmp_path.glob(".*quantizing"))
