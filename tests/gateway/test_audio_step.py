"""
The audio step's converter (blazar.gateway.audio): FFmpeg's decoders by
way of PyAV, never Blazar's own.
"""

from __future__ import annotations

import io
import wave
from typing import cast

import pytest
from twisted.python.failure import Failure

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


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "empty"),
        (b"this is plainly text, not audio" * 20, "could not be decoded"),
    ],
)
def test_what_ffmpeg_cannot_read_is_refused(data: bytes, reason: str) -> None:
    with pytest.raises(AudioUnreadable, match=reason):
        thd_to_wav(data)


def test_too_long_is_refused_while_decoding() -> None:
    with pytest.raises(AudioUnreadable, match="longer than"):
        thd_to_wav(wav(16000, 1, 16000 * 3), max_seconds=1.0)


def test_a_playlist_naming_local_files_is_refused(tmp_path: object) -> None:
    # FFmpeg's concat demuxer would open the files it names (beside the daemon); only media demuxers read
    with pytest.raises(AudioUnreadable, match="could not be decoded"):
        thd_to_wav(b"ffconcat version 1.0\nfile 'secret.wav'\n")
    with pytest.raises(AudioUnreadable):
        thd_to_wav(b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nsecret.wav\n#EXT-X-ENDLIST\n")


def test_bounded_work_holds_its_place_until_the_thread_ends() -> None:
    from twisted.internet.defer import CancelledError, Deferred, ensureDeferred

    from blazar.gateway.pipeline import Bounded

    started: list[Deferred[str]] = []

    def in_thread(f: object, *args: object) -> Deferred[str]:
        d: Deferred[str] = Deferred()
        started.append(d)
        return d

    bounded = Bounded(1)
    first = ensureDeferred(bounded.run(in_thread, print))
    second = ensureDeferred(bounded.run(in_thread, print))
    assert len(started) == 1 and bounded.running == 1
    first.cancel()  # the first caller's client left: its decode still runs
    assert isinstance(cast(Failure, first.result).value, CancelledError)
    first.addErrback(lambda f: None)
    assert len(started) == 1, "a second decode started while the first still ran"
    started[0].callback("done")  # the thread ends: the second starts
    assert len(started) == 2 and bounded.running == 1
    started[1].callback("two")
    assert second.result == "two" and bounded.running == 0
    third = ensureDeferred(bounded.run(in_thread, print))
    started[2].errback(ValueError("bad"))
    assert isinstance(cast(Failure, third.result).value, ValueError) and bounded.running == 0
    third.addErrback(lambda f: None)
