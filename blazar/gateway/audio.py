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
import struct
from typing import Mapping

from blazar.httpbody import multipart_body

SAMPLE_RATE = 16000  # WHISPER_SAMPLE_RATE
MAX_SECONDS = 3 * 3600.0  # longer uploads are refused before decoding the rest (3 h: 346 MB of PCM)
# FFmpeg's demuxers an upload may be read with: media containers only. Without the list FFmpeg
# would also take a playlist (concat, hls, ...) and open the files it names, beside the daemon.
DEMUXERS = "wav,w64,mp3,ogg,flac,mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,aac,aiff,caf,amr,au,asf"
IMAGE_DEMUXERS = "png_pipe,jpeg_pipe,webp_pipe,bmp_pipe,gif,image2"


class AudioUnreadable(Exception):
    """
    The upload is not audio FFmpeg can decode; the message says what was
    wrong (a 400 on the surface).
    """


def thd_to_pcm(data: bytes, max_seconds: float = MAX_SECONDS) -> bytearray:
    """
    Decode C{data} and resample it to 16 kHz mono signed 16-bit PCM, read
    only with the media demuxers of L{DEMUXERS}.

    @return: The samples.
    @raise AudioUnreadable: No audio stream, undecodable, empty or too long.
    """
    import av  # PyAV: FFmpeg's demuxers, decoders and resampler

    if not data:
        raise AudioUnreadable("the uploaded file is empty")
    pcm = bytearray()
    try:
        with av.open(io.BytesIO(data), mode="r", options={"format_whitelist": DEMUXERS}) as container:
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
    return pcm


def wav_header(samples: int) -> bytes:
    """
    The 44-byte RIFF header of a 16 kHz mono 16-bit PCM WAV of C{samples}
    samples (the canonical layout: RIFF, fmt, data).
    """
    size = samples * 2
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF",
        36 + size,
        b"WAVE",
        b"fmt ",
        16,
        1,
        1,
        SAMPLE_RATE,
        SAMPLE_RATE * 2,
        2,
        16,
        b"data",
        size,
    )


def thd_to_wav(data: bytes, max_seconds: float = MAX_SECONDS) -> tuple[bytes, float]:
    """
    L{thd_to_pcm} as a WAV file's bytes, and the audio's length in seconds.
    """
    pcm = thd_to_pcm(data, max_seconds)
    return wav_header(len(pcm) // 2) + bytes(pcm), len(pcm) / 2 / SAMPLE_RATE


def thd_to_multipart(
    data: bytes,
    fields: Mapping[str, str],
    max_seconds: float = MAX_SECONDS,
) -> tuple[bytes, str, float]:
    """
    The child's whole C{multipart/form-data} body: C{fields} and the upload
    as a 16 kHz WAV C{file} part, built with one copy of the samples (a
    3 h upload is 346 MB of them).

    @return: The body, its content type, and the audio's seconds.
    @raise AudioUnreadable: As L{thd_to_pcm}.
    """
    pcm = thd_to_pcm(data, max_seconds)
    seconds = len(pcm) / 2 / SAMPLE_RATE
    body, content_type = multipart_body(fields, [("file", "audio.wav", "audio/wav", (wav_header(len(pcm) // 2), pcm))])
    return body, content_type, seconds


def thd_image_size(data: bytes) -> tuple[int, int]:
    """
    An uploaded image's width and height, from its header (FFmpeg's image
    demuxers, L{IMAGE_DEMUXERS}; nothing is decoded).

    @raise AudioUnreadable: Not an image they read.
    """
    import av

    try:
        with av.open(io.BytesIO(data), mode="r", options={"format_whitelist": IMAGE_DEMUXERS}) as container:
            video = [s for s in container.streams.video]
            if not video or not video[0].width:
                raise AudioUnreadable("the uploaded image has no picture")
            return int(video[0].width), int(video[0].height)
    except AudioUnreadable:
        raise
    except Exception as e:
        reason = str(e).split(": '<", 1)[0] or type(e).__name__
        raise AudioUnreadable(f"the uploaded image could not be read as PNG, JPEG or WebP ({reason})") from None
