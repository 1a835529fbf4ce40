"""
Speech to text on the same port (issue 23): a generated tiny random-weight
whisper model (blazar.models.testwhisper) served by the real whisper-server
built here, through the openai SDK's audio.transcriptions and
audio.translations: a WAV, an MP3 and an OGG/Opus made by the test, every
response_format, an unreadable file, the wrong models, and the child
stopped after whisper_idle_secs and started again by the next request.
"""

from __future__ import annotations

import io
import json
import math
import re
import signal
import subprocess
import sys
import time
import wave
from pathlib import Path
from typing import Any, Iterator, cast

import openai
import psutil
import pytest

from blazar.models.testmodel import make_test_model
from blazar.models.testwhisper import make_test_whisper_model
from tests.integration.harness import Daemon, lane_binary

IDLE = 4
ROOT = "root-secret-0123456789"
STT = "stt-secret-0123456789"


def tone(seconds: float = 2.0, rate: int = 16000) -> Any:
    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * math.pi * 440 * t) * 32767).astype("<i2")


def wav_bytes(seconds: float = 2.0, rate: int = 22050) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(tone(seconds, rate).tobytes())
    return out.getvalue()


def encoded(container: str, codec: str, rate: int) -> bytes:
    """
    The tone, encoded by FFmpeg (PyAV) as C{container}/C{codec}.
    """
    import av

    samples = tone(2.0, 16000)
    out = io.BytesIO()
    with av.open(out, "w", format=container) as c:
        stream = cast(av.AudioStream, c.add_stream(codec, rate=rate))
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = 16000
        resampler = av.AudioResampler(format=stream.format.name, layout="mono", rate=rate)
        for f in resampler.resample(frame):
            for packet in stream.encode(f):
                c.mux(packet)
        for packet in stream.encode(None):
            c.mux(packet)
    return out.getvalue()


@pytest.fixture(scope="module")
def daemon(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("audio")
    models = root / "models"
    models.mkdir()
    make_test_whisper_model(models / "ggml-tiny-test.bin")  # found by its magic: whisper-tiny-test
    make_test_model(models / "tiny.gguf")
    d = Daemon(
        root,
        (
            f'models_dir = "{models}"\nwhisper_idle_secs = {IDLE}\nready_timeout = 60\n'
            f'audit_log = "{root / "audit.jsonl"}"\n'
            f'[[keys]]\nname = "root"\nsecret = "{ROOT}"\n'
            # a scoped key whose token limit counts audio seconds
            f'[[keys]]\nname = "stt"\nsecret = "{STT}"\nmodels = ["whisper-1"]\ndaily_tokens = 5\n'
            '[models."whisper-1"]\npath = "ggml-tiny-test.bin"\n'  # the name OpenAI clients send
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
            f'[engines.whisper]\nbinary = "{lane_binary("whisper")}"\nargs = ["--threads", "1"]\n'
        ),
    )
    d.start()
    yield d
    code = d.stop()
    leftovers = d.leftovers
    d.kill_everything()
    assert code in (0, -signal.SIGTERM), d.log()[-3000:]
    assert leftovers == [], "whisper-server outlived the daemon"


def client(d: Daemon, key: str = ROOT) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key=key, max_retries=0, timeout=120)


def whisper_children(d: Daemon) -> list[psutil.Process]:
    return d.engines(("whisper-server",))


def test_every_response_format_from_a_wav_with_the_openai_sdk(daemon: Daemon, tmp_path: Path) -> None:
    audio = tmp_path / "tone.wav"
    audio.write_bytes(wav_bytes())  # 22.05 kHz: the gateway resamples it
    c = client(daemon)
    with audio.open("rb") as f:
        answer = c.audio.transcriptions.create(model="whisper-1", file=f)
    assert isinstance(answer.text, str)
    with audio.open("rb") as f:
        verbose = c.audio.transcriptions.create(
            model="whisper-tiny-test",
            file=f,
            response_format="verbose_json",
            timestamp_granularities=["word", "segment"],
            language="en",
        )
    assert (verbose.model_extra or {})["task"] == "transcribe" and abs(verbose.duration - 2.0) < 0.05, verbose
    assert verbose.segments is not None and verbose.words is not None
    for segment in verbose.segments:
        assert 0 <= segment.start <= segment.end
    for fmt, shape in (
        ("text", r"(?s).*\n"),
        ("srt", r"(?s)(1\n\d\d:\d\d:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}\n.*)?"),
        ("vtt", r"(?s)WEBVTT\n\n.*"),
    ):
        with audio.open("rb") as f:
            body = c.audio.transcriptions.create(model="whisper-1", file=f, response_format=cast(Any, fmt))
        assert isinstance(body, str) and re.fullmatch(shape, body), (fmt, body)
    status, headers, raw = daemon.request("GET", "/v1/models", headers={"authorization": f"Bearer {ROOT}"})
    kinds = {m["id"]: m["kind"] for m in json.loads(raw)["data"]}
    assert kinds["whisper-tiny-test:latest"] == "transcription" and kinds["tiny:latest"] == "chat", kinds
    status, _, metrics = daemon.request("GET", "/metrics", headers={"authorization": f"Bearer {ROOT}"})
    assert re.search(rb'blazar_audio_seconds_total\{key="root",model="whisper-1:latest"\} ([0-9.]+)', metrics), metrics[
        -2000:
    ]
    assert re.search(rb'blazar_instances_by_lane\{lane="whisper"\} [12]\.0', metrics), metrics[-2000:]
    status, _, raw = daemon.request("GET", "/api/tags", headers={"authorization": f"Bearer {ROOT}"})
    tags = {m["name"]: m for m in json.loads(raw)["models"]}
    assert status == 200 and tags["whisper-tiny-test:latest"]["kind"] == "transcription", tags
    ps = subprocess.run(
        [str(Path(sys.executable).parent / "blazar"), "ps", "--json", "-c", str(daemon.config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = {r["model"]: r for r in json.loads(ps.stdout)}
    assert rows["whisper-1:latest"]["kind"] == "transcription" and rows["whisper-1:latest"]["lane"] == "whisper", rows
    assert rows["whisper-1:latest"]["slots"] == 1, rows  # one request at a time, as admission gives it


def test_mp3_and_ogg_and_a_translation(daemon: Daemon) -> None:
    c = client(daemon)
    for name, data in (
        ("tone.mp3", encoded("mp3", "libmp3lame", 44100)),
        ("tone.ogg", encoded("ogg", "libopus", 48000)),
    ):
        answer = c.audio.transcriptions.create(model="whisper-1", file=(name, data), response_format="verbose_json")
        assert abs(answer.duration - 2.0) < 0.1, (name, answer.duration)
    translated = c.audio.translations.create(
        model="whisper-1", file=("tone.wav", wav_bytes()), response_format="verbose_json"
    )
    assert (translated.model_extra or {})["task"] == "translate"


def test_an_unreadable_file_and_the_wrong_models(daemon: Daemon) -> None:
    c = client(daemon)
    with pytest.raises(openai.BadRequestError) as bad:
        c.audio.transcriptions.create(model="whisper-1", file=("notes.mp3", b"this is not audio at all" * 50))
    assert "could not be decoded as audio" in str(bad.value) and cast(dict[str, Any], bad.value.body)["param"] == "file"
    with pytest.raises(openai.BadRequestError) as wrong:
        c.audio.transcriptions.create(model="tiny", file=("tone.wav", wav_bytes()))
    assert "not a speech-to-text model" in str(wrong.value)
    with pytest.raises(openai.BadRequestError) as chat:
        c.chat.completions.create(model="whisper-1", messages=[{"role": "user", "content": "hi"}])
    assert "POST /v1/audio/transcriptions" in str(chat.value)
    # a playlist naming a file beside the daemon: never opened (only media demuxers read uploads)
    with pytest.raises(openai.BadRequestError) as playlist:
        c.audio.transcriptions.create(model="whisper-1", file=("notes.txt", b"ffconcat version 1.0\nfile 'x.wav'\n"))
    assert "could not be decoded as audio" in str(playlist.value)
    with pytest.raises(openai.BadRequestError) as lang:
        c.audio.transcriptions.create(model="whisper-1", file=("tone.wav", wav_bytes()), language="zz")
    assert "language" in str(lang.value)
    regional = c.audio.transcriptions.create(model="whisper-1", file=("tone.wav", wav_bytes()), language="en-US")
    assert isinstance(regional.text, str)  # the language alone: en
    with pytest.raises(openai.BadRequestError) as fmt:
        c.audio.transcriptions.create(
            model="whisper-1", file=("tone.wav", wav_bytes()), response_format=cast(Any, "yaml")
        )  # not a format, on purpose
    assert "response_format" in str(fmt.value)


def gone_within(daemon: Daemon, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while whisper_children(daemon) and time.monotonic() < deadline:
        time.sleep(0.25)
    return not whisper_children(daemon)


def test_the_child_is_stopped_when_idle_and_started_again(daemon: Daemon) -> None:
    c = client(daemon)
    assert gone_within(daemon, IDLE + 30), "earlier tests' whisper-servers still run after whisper_idle_secs"
    c.audio.transcriptions.create(model="whisper-1", file=("tone.wav", wav_bytes()))
    (child,) = whisper_children(daemon)
    assert "--request-path" in child.cmdline()
    assert gone_within(daemon, IDLE + 30), "whisper-server still runs after whisper_idle_secs"
    answer = c.audio.transcriptions.create(model="whisper-1", file=("tone.wav", wav_bytes()))
    assert isinstance(answer.text, str)
    (again,) = whisper_children(daemon)
    assert again.pid != child.pid


def test_keys_scopes_token_limits_and_the_audit_line(daemon: Daemon) -> None:
    scoped = client(daemon, STT)
    with pytest.raises(openai.NotFoundError):  # outside its scope: as if it did not exist
        scoped.audio.transcriptions.create(model="whisper-tiny-test", file=("tone.wav", wav_bytes()))
    with pytest.raises(openai.AuthenticationError):
        client(daemon, "wrong-secret-0123456789").audio.transcriptions.create(
            model="whisper-1", file=("tone.wav", wav_bytes())
        )
    for _ in range(3):  # 2 s each: one token per second of audio, 6 > daily_tokens 5
        scoped.audio.transcriptions.create(model="whisper-1", file=("tone.wav", wav_bytes()))
    with pytest.raises(openai.RateLimitError) as over:
        scoped.audio.transcriptions.create(model="whisper-1", file=("tone.wav", wav_bytes()))
    assert "daily_tokens" in str(over.value)
    lines = [json.loads(line) for line in (daemon.root / "audit.jsonl").read_text().splitlines()]
    mine = [e for e in lines if e["key"] == "stt" and e["status"] == 200]
    assert len(mine) == 3 and all(abs(e["audio_seconds"] - 2.0) < 0.05 for e in mine), mine
