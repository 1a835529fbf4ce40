"""
The audio step of a speech-to-text call (issue 23): whatever the client
uploaded (any container and codec FFmpeg reads: WAV, MP3, OGG/Opus,
FLAC, M4A/AAC, WebM from a browser's recorder, ...) becomes the 16 kHz
mono 16-bit WAV whisper.cpp reads, decoded and resampled by PyAV
(FFmpeg's libraries), never by code of Blazar's. The child gets it as
the C{file} part of a C{multipart/form-data} body beside its other
fields (L{blazar.httpbody.multipart_body}).

Blocking (decoding is CPU work): the pipeline runs L{thd_to_wav} in the
thread pool.
"""

from __future__ import annotations

import io
import wave

SAMPLE_RATE = 16000  # WHISPER_SAMPLE_RATE
MAX_SECONDS = 3 * 3600.0  # longer uploads are refused before decoding the rest (3 h: 346 MB of PCM)


class AudioUnreadable(Exception):
    """
    The upload is not audio FFmpeg can decode; the message says what was
    wrong (a 400 on the surface).
    """


def thd_to_wav(data: bytes, max_seconds: float = MAX_SECONDS) -> tuple[bytes, float]:
    """
    Decode C{data} and resample it to 16 kHz mono signed 16-bit PCM.

    @return: The WAV file's bytes and the audio's length in seconds.
    @raise AudioUnreadable: No audio stream, undecodable, empty or too long.
    """
    import av  # PyAV: FFmpeg's demuxers, decoders and resampler

    if not data:
        raise AudioUnreadable("the uploaded file is empty")
    pcm = bytearray()
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            streams = [s for s in container.streams if s.type == "audio"]
            if not streams:
                raise AudioUnreadable("the uploaded file has no audio stream")
            resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
            for frame in container.decode(streams[0]):
                assert isinstance(frame, av.AudioFrame)
                for out in resampler.resample(frame):
                    pcm += bytes(out.planes[0])[: out.samples * 2]
                if len(pcm) / 2 / SAMPLE_RATE > max_seconds:
                    raise AudioUnreadable(f"the audio is longer than {max_seconds / 3600:g} hours; split it")
            for out in resampler.resample(None):  # flush
                pcm += bytes(out.planes[0])[: out.samples * 2]
    except AudioUnreadable:
        raise
    except Exception as e:  # av.error.FFmpegError and its kin: not audio FFmpeg can read
        reason = str(e).split(": '<", 1)[0] or type(e).__name__
        raise AudioUnreadable(f"the uploaded file could not be decoded as audio ({reason})") from None
    if not pcm:
        raise AudioUnreadable("the uploaded file holds no audio samples")
    out_file = io.BytesIO()
    with wave.open(out_file, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm)
    return out_file.getvalue(), len(pcm) / 2 / SAMPLE_RATE
