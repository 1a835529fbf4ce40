"""
Image generation (issue 23): OpenAI's C{/v1/images/generations} and
C{/v1/images/edits} to and from stable-diffusion.cpp's C{sd-server}.

sd-server reads C{prompt}, C{n}, C{size}, C{output_format} and
C{output_compression} from OpenAI's fields; whatever else it can do
(seed, steps, guidance, a negative prompt) it takes from a JSON object
between C{<sd_cpp_extra_args>} tags inside the prompt, so the fields
OpenAI-style clients send for those (C{seed}, C{steps},
C{negative_prompt}, C{cfg_scale} / C{guidance_scale}) are put there. It
always answers C{b64_json}; C{response_format: "url"} is Blazar's (the
surface keeps the image and serves it, expiring). Field reference:
platform.openai.com/docs/api-reference/images.

Pure functions: no reactor, no I/O.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from blazar import strictjson
from blazar.gateway.errors import BadRequest

OUTPUT_FORMATS = ("png", "jpeg")  # sd-server built without libwebp (blazar.engines.build)
RESPONSE_FORMATS = ("b64_json", "url")
MAX_N = 10
MAX_SIDE = 2048
MAX_PROMPT = 4000  # characters (dall-e-3's limit): sd-server's text encoders crash or take GBs on longer ones
# OpenAI's fields a diffusion model has no use for: accepted, named in x-blazar-ignored
IGNORED = ("quality", "style", "background", "moderation", "user", "input_fidelity", "partial_images")
_SIZE = re.compile(r"([1-9][0-9]{0,4})x([1-9][0-9]{0,4})")


def _int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be an integer from {low} to {high}", name)
    return value


def decode(body: Mapping[str, Any]) -> tuple[dict[str, Any], str, list[str]]:
    """
    Check an image request's fields (JSON for generations; the text
    fields of the multipart form for edits, numbers still as strings
    there: L{form_fields} turns them into JSON values first).

    @return: sd-server's JSON body, the C{response_format}, and the names
        accepted but not honoured.
    @raise BadRequest: A field of the wrong type or an impossible value,
        named.
    """
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRequest("'prompt' must be a non-empty string describing the image", "prompt")
    _text(prompt, "prompt")
    if "<sd_cpp_extra_args>" in prompt:
        raise BadRequest(
            "'prompt' may not carry <sd_cpp_extra_args>: use the fields seed, steps, negative_prompt and cfg_scale",
            "prompt",
        )
    if body.get("stream") not in (None, False):
        raise BadRequest(
            "'stream' (partial images) is not supported by stable-diffusion.cpp: send it without stream", "stream"
        )
    engine: dict[str, Any] = {"n": _int(body.get("n", 1), "n", 1, MAX_N)}
    size = body.get("size")
    if size is not None and size != "auto":
        found = _SIZE.fullmatch(size) if isinstance(size, str) else None
        if not found or not all(16 <= int(side) <= MAX_SIDE for side in found.groups()):
            raise BadRequest(f"'size' must be 'auto' or WIDTHxHEIGHT (16 to {MAX_SIDE} each, e.g. 512x512)", "size")
        engine["size"] = size
    response_format = body.get("response_format") or "b64_json"
    if response_format not in RESPONSE_FORMATS:
        raise BadRequest("'response_format' must be 'b64_json' or 'url'", "response_format")
    output_format = body.get("output_format") or "png"
    if output_format not in OUTPUT_FORMATS:
        raise BadRequest("'output_format' must be 'png' or 'jpeg' (this engine writes no webp)", "output_format")
    engine["output_format"] = output_format
    if "output_compression" in body:
        engine["output_compression"] = _int(body["output_compression"], "output_compression", 0, 100)
    extra: dict[str, Any] = {}
    if body.get("seed") is not None:
        extra["seed"] = _int(body["seed"], "seed", -1, 2**63 - 1)
    steps = body.get("steps", body.get("num_inference_steps"))
    guidance = body.get("cfg_scale", body.get("guidance_scale"))
    sample: dict[str, Any] = {}
    if steps is not None:
        sample["sample_steps"] = _int(steps, "steps", 1, 150)
    if guidance is not None:
        if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not 0 <= guidance <= 100:
            raise BadRequest("'cfg_scale' must be a number from 0 to 100", "cfg_scale")
        sample["guidance"] = {"txt_cfg": float(guidance)}
    if sample:
        extra["sample_params"] = sample
    negative = body.get("negative_prompt")
    if negative is not None:
        if not isinstance(negative, str):
            raise BadRequest("'negative_prompt' must be a string", "negative_prompt")
        _text(negative, "negative_prompt")
        extra["negative_prompt"] = negative
    if extra:
        prompt += f"<sd_cpp_extra_args>{strictjson.encode(extra)}</sd_cpp_extra_args>"
    engine["prompt"] = prompt
    return engine, response_format, [name for name in IGNORED if name in body]


def _text(value: str, name: str) -> None:
    if len(value) > MAX_PROMPT:
        raise BadRequest(f"'{name}' is {len(value)} characters; at most {MAX_PROMPT}", name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"'{name}' is not valid Unicode text (a lone surrogate)", name) from None
    if "</sd_cpp_extra_args>" in value:
        raise BadRequest(f"'{name}' may not carry sd_cpp_extra_args tags", name)


def form_fields(form: Mapping[str, list[str]]) -> dict[str, Any]:
    """
    An edit's multipart text fields as the JSON values L{decode} checks
    (numbers parsed; a field that does not parse stays a string, which
    L{decode} then refuses by name).
    """
    out: dict[str, Any] = {}
    for name, values in form.items():
        if not values:
            continue
        value: Any = values[-1]
        if name in ("n", "seed", "steps", "num_inference_steps", "output_compression"):
            try:
                value = int(value)
            except ValueError:
                pass
        elif name in ("cfg_scale", "guidance_scale"):
            try:
                value = float(value)
            except ValueError:
                pass
        elif name == "stream":
            value = value.lower() == "true"
        out[name] = value
    return out


def encode(
    answer: Mapping[str, Any],
    response_format: str,
    output_format: str,
    created: int,
    url_for: Callable[[str, str], str],
) -> dict[str, Any]:
    """
    OpenAI's answer from sd-server's (C{{"created", "data": [{"b64_json"}],
    "output_format"}}).

    @param url_for: For C{response_format: "url"}: keeps one image (its
        base64 and format) and returns the address it is served at.
    """
    data = []
    for item in answer.get("data") or []:
        if not isinstance(item, dict) or not isinstance(item.get("b64_json"), str):
            continue
        if response_format == "url":
            data.append({"url": url_for(item["b64_json"], output_format)})
        else:
            data.append({"b64_json": item["b64_json"]})
    return {"created": int(answer.get("created") or created), "data": data, "output_format": output_format}
