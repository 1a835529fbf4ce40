"""
The speech-to-text and image translators (blazar.web.translate.audio,
.images), the multipart body both ways, and the images kept for URLs.
"""

from __future__ import annotations

import base64
import io
import json

import multipart
import pytest
from twisted.internet.task import Clock

from blazar.gateway.errors import BadRequest
from blazar.httpbody import multipart_body
from blazar.web.openai import HELD_SECS, HeldImages
from blazar.web.translate import audio, images

VERBOSE = {
    "task": "transcribe",
    "language": "english",
    "duration": 2.0,
    "text": " hello there\n",
    "segments": [
        {
            "id": 0,
            "text": " hello",
            "start": 0.0,
            "end": 1.25,
            "tokens": [11, 12],
            "temperature": 0.0,
            "avg_logprob": -0.5,
            "no_speech_prob": 0.01,
            "words": [{"word": " hello", "start": 0.0, "end": 1.25}],
        },
        {
            "id": 1,
            "text": " there",
            "start": 1.25,
            "end": 3661.5,
            "tokens": [13],
            "temperature": 0.0,
            "avg_logprob": float("nan"),
            "no_speech_prob": 0.02,
            "words": [{"word": " there", "start": 1.3, "end": 2.0}],
        },
    ],
}


def test_audio_fields_to_whisper_server() -> None:
    fields, fmt, grains, ignored = audio.decode(
        {"temperature": ["0.2"], "language": ["DE"], "prompt": ["names"], "stream": ["true"]}, translate=False
    )
    assert fields == {
        "response_format": "verbose_json",
        "translate": "false",
        "temperature": "0.2",
        "language": "de",
        "prompt": "names",
    }
    assert (fmt, grains, ignored) == ("json", (), ["stream"])
    fields, fmt, grains, ignored = audio.decode(
        {"response_format": ["verbose_json"], "language": ["en"], "timestamp_granularities[]": ["word", "segment"]},
        translate=True,
    )
    assert fields["language"] == "auto" and fields["translate"] == "true" and fields["token_timestamps"] == "true"
    assert grains == ("word", "segment") and ignored == ["language"]  # translations detect their language
    assert audio.decode({}, translate=False)[0]["language"] == "auto"  # whisper-server would assume English


@pytest.mark.parametrize(
    "form, param",
    [
        ({"response_format": ["yaml"]}, "response_format"),
        ({"response_format": ["diarized_json"]}, "response_format"),
        ({"temperature": ["hot"]}, "temperature"),
        ({"temperature": ["1.5"]}, "temperature"),
        ({"temperature": ["nan"]}, "temperature"),
        ({"language": ["en; rm -rf"]}, "language"),
        ({"timestamp_granularities[]": ["char"], "response_format": ["verbose_json"]}, "timestamp_granularities"),
        ({"timestamp_granularities[]": ["word"]}, "timestamp_granularities"),  # needs verbose_json
    ],
)
def test_impossible_audio_fields_are_400s_naming_them(form: dict[str, list[str]], param: str) -> None:
    with pytest.raises(BadRequest) as e:
        audio.decode(form, translate=False)
    assert e.value.param == param


def test_every_response_format_from_verbose_json() -> None:
    body, ctype = audio.encode(VERBOSE, "json", (), False, 1.2)
    assert json.loads(body) == {"text": "hello there", "usage": {"type": "duration", "seconds": 2}}
    assert ctype == "application/json"
    assert audio.encode(VERBOSE, "text", (), False, 2)[0] == b"hello there\n"
    srt = audio.encode(VERBOSE, "srt", (), False, 2)[0].decode()
    # the second segment's end (whisper's window end) is clamped to the audio's 2 s
    assert srt == "1\n00:00:00,000 --> 00:00:01,250\nhello\n\n2\n00:00:01,250 --> 00:00:02,000\nthere\n\n"
    assert audio._clock(3661.5, ",") == "01:01:01,500" and audio._clock(-1, ".") == "00:00:00.000"
    vtt = audio.encode(VERBOSE, "vtt", (), False, 2)[0].decode()
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.250\nhello\n\n00:00:01.250 --> 00:00:02.000\n")
    verbose = json.loads(audio.encode(VERBOSE, "verbose_json", ("word",), True, 2)[0])
    assert verbose["task"] == "translate" and "segments" not in verbose  # words only, as asked
    assert verbose["words"] == [
        {"word": "hello", "start": 0.0, "end": 1.25},
        {"word": "there", "start": 1.3, "end": 2.0},
    ]
    full = json.loads(audio.encode(VERBOSE, "verbose_json", (), False, 2)[0])
    assert [s["avg_logprob"] for s in full["segments"]] == [-0.5, 0.0]  # NaN is not JSON
    assert full["segments"][0]["tokens"] == [11, 12] and full["language"] == "english"
    assert json.loads(audio.encode({}, "verbose_json", (), False, 0.4)[0])["usage"]["seconds"] == 1


def test_image_fields_to_sd_server() -> None:
    engine, fmt, ignored = images.decode(
        {
            "prompt": "a fox",
            "size": "64x64",
            "n": 2,
            "seed": 42,
            "steps": 4,
            "cfg_scale": 1.5,
            "negative_prompt": "blur",
            "quality": "hd",
            "response_format": "url",
        }
    )
    extra = {"seed": 42, "sample_params": {"sample_steps": 4, "guidance": {"txt_cfg": 1.5}}, "negative_prompt": "blur"}
    assert engine == {
        "n": 2,
        "size": "64x64",
        "output_format": "png",
        "prompt": f"a fox<sd_cpp_extra_args>{json.dumps(extra)}</sd_cpp_extra_args>",
    }
    assert (fmt, ignored) == ("url", ["quality"])
    assert images.decode({"prompt": "x", "size": "auto"})[0] == {"n": 1, "output_format": "png", "prompt": "x"}
    assert images.form_fields({"n": ["2"], "seed": ["x"], "cfg_scale": ["2.5"], "prompt": ["p"]}) == {
        "n": 2,
        "seed": "x",
        "cfg_scale": 2.5,
        "prompt": "p",
    }


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": "  "}, "prompt"),
        ({"prompt": "a <sd_cpp_extra_args>{}</sd_cpp_extra_args>"}, "prompt"),
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "n": True}, "n"),
        ({"prompt": "a", "size": "64"}, "size"),
        ({"prompt": "a", "size": "8x8"}, "size"),
        ({"prompt": "a", "response_format": "png"}, "response_format"),
        ({"prompt": "a", "output_format": "webp"}, "output_format"),
        ({"prompt": "a", "steps": 0}, "steps"),
        ({"prompt": "a", "seed": "42"}, "seed"),
        ({"prompt": "a", "stream": True}, "stream"),
        ({"prompt": "a", "cfg_scale": "hi"}, "cfg_scale"),
        ({"prompt": "a", "negative_prompt": 3}, "negative_prompt"),
    ],
)
def test_impossible_image_fields_are_400s_naming_them(body: dict[str, object], param: str) -> None:
    with pytest.raises(BadRequest) as e:
        images.decode(body)
    assert e.value.param == param


def test_image_answers_as_b64_or_url() -> None:
    answer = {"created": 7, "data": [{"b64_json": base64.b64encode(b"PNG1").decode()}, {"nope": 1}]}
    assert images.encode(answer, "b64_json", "png", 9, lambda b, f: "")["data"] == [{"b64_json": "UE5HMQ=="}]
    kept: list[tuple[str, str]] = []

    def keep(b: str, f: str) -> str:
        kept.append((b, f))
        return "http://x/1.jpg"

    out = images.encode(answer, "url", "jpeg", 9, keep)
    assert out == {"created": 7, "data": [{"url": "http://x/1.jpg"}], "output_format": "jpeg"}
    assert kept == [("UE5HMQ==", "jpeg")]


def test_held_images_expire_and_are_bounded() -> None:
    clock = Clock()
    held = HeldImages(clock)
    token = held.keep(base64.b64encode(b"\x89PNG...").decode(), "png")
    assert token.endswith(".png") and len(token) > 30
    assert held.get(token) == (b"\x89PNG...", "image/png")
    assert held.get("guess.png") is None
    clock.advance(HELD_SECS)
    assert held.get(token) is None


def test_multipart_round_trip_through_the_library() -> None:
    body, ctype = multipart_body({"prompt": 'say "hi"\r\n'}, [("image[]", 'a"b.png', "image/png", b"\x00--\r\n")])
    _, options = multipart.parse_options_header(ctype)
    parts = list(multipart.MultipartParser(io.BytesIO(body), options["boundary"], len(body), strict=True))
    assert [(p.name, p.filename, p.raw) for p in parts] == [
        ("prompt", None, b'say "hi"\r\n'),
        ("image[]", 'a"b.png', b"\x00--\r\n"),
    ]  # quotes escaped as browsers do
