"""
Speech to text (issue 23): OpenAI's C{/v1/audio/transcriptions} and
C{/v1/audio/translations} (multipart form fields, the five
C{response_format}s) to and from whisper.cpp's C{whisper-server}
C{/inference}.

The child is always asked for its C{verbose_json} (segments with times,
tokens, probabilities); every format the client asked for is made here
from it, so all five are OpenAI's shape whatever the server version
prints. Field reference: platform.openai.com/docs/api-reference/audio.

Pure functions: no reactor, no I/O.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from blazar import strictjson
from blazar.gateway.errors import BadRequest

FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
# whisper.cpp's languages (its g_lang), ISO-639-1 where one exists
LANGUAGES = frozenset(
    "en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur hr bg lt la mi "
    "ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si km sn yo so af oc ka be tg sd "
    "gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha ba jw su yue".split()
)
CONTENT_TYPES = {
    "json": "application/json",
    "verbose_json": "application/json",
    "text": "text/plain; charset=utf-8",
    "srt": "application/x-subrip; charset=utf-8",
    "vtt": "text/vtt; charset=utf-8",
}
# accepted and not honoured (whisper models have none of these): named in x-blazar-ignored
IGNORED = (
    "stream",
    "chunking_strategy",
    "include",
    "include[]",
    "known_speaker_names",
    "known_speaker_names[]",
    "known_speaker_references",
    "known_speaker_references[]",
)


def decode(form: Mapping[str, list[str]], translate: bool) -> tuple[dict[str, str], str, tuple[str, ...], list[str]]:
    """
    Check a transcription or translation request's text fields.

    @param form: Field name to its values (the file part is not here).
    @return: The whisper-server fields, the C{response_format}, the
        timestamp granularities, and the names accepted but not honoured.
    @raise BadRequest: A field of the wrong type or an impossible value,
        named.
    """

    def one(name: str) -> str | None:
        values = form.get(name)
        return values[-1] if values else None

    response_format = one("response_format") or "json"
    if response_format == "diarized_json":
        raise BadRequest(
            "response_format 'diarized_json' needs a diarizing model (OpenAI's "
            "gpt-4o-transcribe-diarize); whisper models answer json, text, srt, verbose_json or vtt",
            "response_format",
        )
    if response_format not in FORMATS:
        raise BadRequest(f"response_format must be one of {', '.join(FORMATS)}", "response_format")
    fields = {"response_format": "verbose_json", "translate": "true" if translate else "false"}
    temperature = one("temperature")
    if temperature is not None:
        try:
            value = float(temperature)
        except ValueError:
            value = math.nan
        if not 0.0 <= value <= 1.0:
            raise BadRequest("temperature must be a number between 0 and 1", "temperature")
        fields["temperature"] = repr(value)
    language = one("language")
    ignored = [name for name in IGNORED if name in form]
    if translate and language is not None:
        ignored.append("language")  # translations detect the language they translate from
    elif language:
        code = language.lower().replace("_", "-").split("-")[0]  # en-US, pt_BR: the language alone
        if code not in LANGUAGES:
            raise BadRequest("language must be an ISO-639-1 code whisper knows, such as 'en' or 'de'", "language")
        fields["language"] = code
    if "language" not in fields:
        fields["language"] = "auto"  # OpenAI detects it when none is given; whisper-server would assume English
    prompt = one("prompt")
    if prompt:
        fields["prompt"] = prompt
    granularities = tuple(
        dict.fromkeys(form.get("timestamp_granularities[]", []) + form.get("timestamp_granularities", []))
    )
    for g in granularities:
        if g not in ("word", "segment"):
            raise BadRequest("timestamp_granularities must be 'word' and/or 'segment'", "timestamp_granularities")
    if granularities and response_format != "verbose_json":
        raise BadRequest("timestamp_granularities needs response_format 'verbose_json'", "timestamp_granularities")
    if "word" in granularities:
        fields["token_timestamps"] = "true"
    return fields, response_format, granularities, ignored


def _clock(seconds: float, mark: str) -> str:
    ms = max(0, int(round(seconds * 1000)))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{mark}{ms:03d}"


def _segments(answer: Mapping[str, Any]) -> list[dict[str, Any]]:
    segments = answer.get("segments")
    return [s for s in segments if isinstance(s, dict)] if isinstance(segments, list) else []


def encode(
    answer: Mapping[str, Any], response_format: str, granularities: tuple[str, ...], translate: bool, seconds: float
) -> tuple[bytes, str]:
    """
    OpenAI's answer in C{response_format}, from whisper-server's
    C{verbose_json} C{answer}.

    @param seconds: The audio's length, as decoded (the usage).
    @return: The body and its content type.
    """
    duration = round(float(answer.get("duration") or seconds), 3)
    segments = [_clamped(s, duration) for s in _segments(answer)]
    text = str(answer.get("text") or "".join(str(s.get("text", "")) for s in segments)).strip()
    usage = {"type": "duration", "seconds": math.ceil(seconds)}
    if response_format == "text":
        return (text + "\n").encode("utf-8"), CONTENT_TYPES["text"]
    if response_format in ("srt", "vtt"):
        mark = "," if response_format == "srt" else "."
        lines = [] if response_format == "srt" else ["WEBVTT", ""]
        for i, s in enumerate(segments, 1):
            if response_format == "srt":
                lines.append(str(i))
            lines.append(f"{_clock(float(s.get('start') or 0), mark)} --> {_clock(float(s.get('end') or 0), mark)}")
            lines += [str(s.get("text", "")).strip(), ""]
        return "\n".join(lines).encode("utf-8") + b"\n", CONTENT_TYPES[response_format]
    if response_format == "json":
        return strictjson.encode({"text": text, "usage": usage}).encode("utf-8"), CONTENT_TYPES["json"]
    out: dict[str, Any] = {
        "task": "translate" if translate else "transcribe",
        "language": str(answer.get("language") or ""),
        "duration": duration,
        "text": text,
    }
    if not granularities or "segment" in granularities:
        out["segments"] = [
            {
                "id": int(s.get("id", i)),
                "seek": 0,
                "start": float(s.get("start") or 0),
                "end": float(s.get("end") or 0),
                "text": str(s.get("text", "")),
                "tokens": [t for t in s.get("tokens") or [] if isinstance(t, int)],
                "temperature": float(s.get("temperature") or 0),
                "avg_logprob": _finite(s.get("avg_logprob")),
                "compression_ratio": 0.0,
                "no_speech_prob": _finite(s.get("no_speech_prob")),
            }
            for i, s in enumerate(segments)
        ]
    if "word" in granularities:
        out["words"] = [
            {
                "word": str(w.get("word", "")).strip(),
                "start": min(float(w.get("start") or 0), duration),
                "end": min(float(w.get("end") or 0), duration),
            }
            for s in segments
            for w in s.get("words") or []
            if isinstance(w, dict) and str(w.get("word", "")).strip()
        ]
    out["usage"] = usage
    return strictjson.encode(out).encode("utf-8"), CONTENT_TYPES["verbose_json"]


def _clamped(segment: dict[str, Any], duration: float) -> dict[str, Any]:
    """
    A segment whose times lie within the audio: whisper.cpp's last segment
    may end at the 30 s window's end, past a shorter recording's.
    """
    out = dict(segment)
    for edge in ("start", "end"):
        out[edge] = min(_finite(segment.get(edge)), duration) if duration > 0 else _finite(segment.get(edge))
    return out


def _finite(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0
    return number if math.isfinite(number) else 0.0
