"""
C{blazar ps}'s GPU lines, from C{Ps} answers as the control channel gives
them (blazar.protocols.control): each GPU with its memory and the models on
it, planned and measured; C{CPU} where no GPU is seen.
"""

from __future__ import annotations

from typing import Any

import pytest

from blazar.cli.status import print_gpus, print_instances

GIB = 2**30


def row(model: str, gpus: list[dict[str, Any]], vram: int = 0) -> dict[str, Any]:
    return {
        "model": model,
        "key": f"{model}#0@text",
        "state": "ready",
        "pid": 42,
        "port": 5555,
        "slots": 4,
        "busy": 0,
        "ctx": 2048,
        "expires_in": None,
        "breaker": "closed",
        "served": 1,
        "memory_estimate": GIB,
        "rss": GIB,
        "cache_hit": None,
        "draft_acceptance": None,
        "kind": "chat",
        "lane": "llamacpp",
        "vram": vram,
        "gpus": gpus,
    }


def gpu(index: int, used: int, total: int = 24 * GIB, name: str = "NVIDIA GeForce RTX 4090") -> dict[str, Any]:
    return {"index": index, "name": name, "memory_total": total, "memory_used": used, "memory_free": total - used}


def test_one_gpu_planned_and_measured(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [row("qwen:7b", [{"gpu": 0, "planned": 4 * GIB, "measured": 5 * GIB}], vram=5 * GIB)]
    print_instances(rows, [gpu(0, 6 * GIB)])
    print_gpus([gpu(0, 6 * GIB)], "", rows)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[-2:] == ["VRAM", "GPU"]
    assert out[1].split()[-2:] == ["5120M", "0"]
    assert out[2] == "GPU 0  NVIDIA GeForce RTX 4090  6.0G used of 24.0G (18.0G free)"
    assert out[3].split() == ["qwen:7b", "5.0G", "measured,", "4.0G", "planned"]


def test_two_gpus_a_split_model_and_an_idle_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        row(
            "big",
            [{"gpu": 0, "planned": 10 * GIB, "measured": None}, {"gpu": 1, "planned": 9 * GIB, "measured": None}],
            vram=19 * GIB,
        ),
        row("small", [{"gpu": 1, "planned": None, "measured": 512 * 2**20}], vram=512 * 2**20),
    ]
    gpus = [gpu(0, 10 * GIB), gpu(1, 10 * GIB), gpu(2, GIB // 2)]
    print_instances(rows, gpus)
    print_gpus(gpus, "", rows)
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[-2:] == ["19456M", "0,1"]
    assert out[2].split()[-2:] == ["512M", "1"]
    assert [line.split() for line in out[3:]] == [
        ["GPU", "0", "NVIDIA", "GeForce", "RTX", "4090", "10.0G", "used", "of", "24.0G", "(14.0G", "free)"],
        ["big", "10.0G", "planned"],
        ["GPU", "1", "NVIDIA", "GeForce", "RTX", "4090", "10.0G", "used", "of", "24.0G", "(14.0G", "free)"],
        ["big", "9.0G", "planned"],
        ["small", "512M", "measured"],
        ["GPU", "2", "NVIDIA", "GeForce", "RTX", "4090", "512M", "used", "of", "24.0G", "(23.5G", "free)"],
        ["(no", "model)"],
    ]


def test_no_gpu_is_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [row("qwen:7b", [])]
    print_instances(rows, [])
    print_gpus([], "NVML unavailable: NVML Shared Library Not Found", rows)
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[-2:] == ["-", "CPU"]
    assert out[2] == "GPUs: none seen, models run on the CPU (NVML unavailable: NVML Shared Library Not Found)"


def test_a_daemon_that_lists_no_gpus_says_nothing_of_them(capsys: pytest.CaptureFixture[str]) -> None:
    old = row("qwen:7b", [])
    del old["vram"], old["gpus"]  # an older daemon: the fields are absent (None over AMP)
    print_instances([old], None)
    assert capsys.readouterr().out.splitlines()[1].split()[-2:] == ["-", "-"]


def test_speculative_decoding_columns(capsys: pytest.CaptureFixture[str]) -> None:
    """
    C{SPEC} (the mode), C{DRAFT} (acceptance) and C{ACC/D} (accepted
    tokens per draft); C{-} before the engine drafted, or from an older
    daemon that sends neither.
    """
    measured = row("coder", [])
    measured.update(speculative="ngram", draft_acceptance=0.575, accepted_per_draft=4.6)
    fresh = row("fresh", [])
    fresh.update(speculative="draft")
    print_instances([measured, fresh, row("old", [])], None)
    out = capsys.readouterr().out.splitlines()
    header = out[0].split()
    spec, draft, per = header.index("SPEC"), header.index("DRAFT"), header.index("ACC/D")
    assert [out[1].split()[i] for i in (spec, draft, per)] == ["ngram", "57%", "4.6"]
    assert [out[2].split()[i] for i in (spec, draft, per)] == ["draft", "-", "-"]
    assert [out[3].split()[i] for i in (spec, draft, per)] == ["-", "-", "-"]
