"""
The audio step's converter (blazar.gateway.audio): FFmpeg's decoders by
way of PyAV, never Blazar's own.
"""

from __future__ import annotations

import io
import wave

import pytest

from blazar.gateway.audio import SAMPLE_RATE, AudioUnreadable, thd_to_wav


def wav(rate: int, channels: int, frames: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x10\x00" * frames * channels)
    return out.getvalue()


def test_any_rate_and_layout_becomes_16k_mono() -> None:
    data, seconds = thd_to_wav(wav(44100, 2, 44100 * 3 // 2))
    assert abs(seconds - 1.5) < 0.01
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SAMPLE_RATE, 1, 2)
        assert abs(w.getnframes() - SAMPLE_RATE * 1.5) < 200


@pytest.mark.parametrize("data, reason", [
    (b"", "empty"), (b"this is plainly text, not audio" * 20, "could not be decoded"),
])
def test_what_ffmpeg_cannot_read_is_refused(data: bytes, reason: str) -> None:
    with pytest.raises(AudioUnreadable, match=reason):
        thd_to_wav(data)


def test_too_long_is_refused_while_decoding() -> None:
    with pytest.raises(AudioUnreadable, match="longer than"):
        thd_to_wav(wav(16000, 1, 16000 * 3), max_seconds=1.0)
