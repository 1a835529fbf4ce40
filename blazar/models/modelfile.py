"""
Ollama's Modelfile: the parser, the renderer, and the typed model
parameters both sides share.

The grammar is the state machine of Ollama's C{parser/parser.go}
(C{ParseFile}), followed rune for rune so that a file Ollama takes is taken
here and one it refuses is refused with its words:

  - a line is C{COMMAND value}; commands are case-insensitive: C{FROM},
    C{PARAMETER name value} (C{stop} repeatable), C{TEMPLATE}, C{SYSTEM},
    C{ADAPTER}, C{LICENSE} (repeatable), C{MESSAGE role value} (role
    C{system}, C{user} or C{assistant}, case-sensitive), and Ollama's newer
    C{DRAFT}, C{RENDERER}, C{PARSER}, C{REQUIRES};
  - a value runs to the end of its line, or, when it opens with C{"} or
    C{\"\"\"}, to the matching close, across lines; the quotes are dropped
    and nothing is unescaped;
  - a C{#} where a command could start begins a comment to the end of the
    line (a C{#} inside a value is part of it);
  - a UTF-8 (or UTF-16) byte-order mark is dropped; characters that are
    not printable (other than tabs and line ends inside a value) are dropped;
  - at least one C{FROM}.

The renderer is Ollama's C{Command.String} and C{Modelfile.String}; the
parameter types are Ollama's C{api.Options} fields (C{FormatParams}), and
L{show_parameters} is C{/api/show}'s C{parameters} text (C{GetModelInfo}).

Pure: no I/O, no reactor.
"""

from __future__ import annotations

import decimal
import math
import re
import struct
from typing import Any, Iterable, Mapping

import attrs

from blazar import strictjson
from blazar.config import ModelConfig


class ModelfileError(ValueError):
    """
    A Modelfile Ollama's parser refuses, or a parameter its C{FormatParams}
    refuses; the message is Ollama's (C{(line 3): command must be one of
    ...}, C{unexpected EOF}, C{no FROM line}, C{unknown parameter 'x'}).
    """


@attrs.frozen
class Command:
    """
    One Modelfile command, as Ollama's parser keeps it.

    @ivar name: C{model} (for C{FROM}), C{adapter}, C{template}, C{system},
        C{license}, C{message}, C{draft}, C{renderer}, C{parser},
        C{requires}, or a parameter's name as written.
    @ivar args: The value, unquoted; a message's is C{"role: content"}.
    """

    name: str
    args: str

    def __str__(self) -> str:
        return render_command(self)


COMMANDS = (
    "from",
    "license",
    "template",
    "system",
    "adapter",
    "draft",
    "renderer",
    "parser",
    "parameter",
    "message",
    "requires",
)
ROLES = ("system", "user", "assistant")

_INVALID_COMMAND = (
    'command must be one of "from", "license", "template", "system", "adapter", "draft", '
    '"renderer", "parser", "parameter", "message", or "requires"'
)
_INVALID_ROLE = 'message role must be one of "system", "user", or "assistant"'
_UNEXPECTED_EOF = "unexpected EOF"

# the parser's states (parser.go's stateNil ... stateComment)
_NIL, _NAME, _VALUE, _PARAMETER, _MESSAGE, _COMMENT = range(6)


def _is_alpha(c: str) -> bool:
    return "a" <= c <= "z" or "A" <= c <= "Z"


def _is_number(c: str) -> bool:
    return "0" <= c <= "9"


def _is_space(c: str) -> bool:
    return c in " \t"


def _is_newline(c: str) -> bool:
    return c in "\r\n"


def _is_print(c: str) -> bool:
    # Go's strconv.IsPrint: letters, marks, numbers, punctuation, symbols and
    # the ASCII space (Python's isprintable() also refuses other spaces)
    return c == " " or c.isprintable()


def _unquote(s: str) -> tuple[str, bool]:
    if s[:3] == '"""':
        if len(s) >= 6 and s[-3:] == '"""':
            return s[3:-3], True
        return "", False
    if s[:1] == '"':
        if len(s) >= 2 and s[-1] == '"':
            return s[1:-1], True
        return "", False
    return s, True


def _next_state(c: str, state: int) -> tuple[int, str, str | None]:
    """
    parser.go's C{parseRuneForState}: the next state, the rune to keep
    (C{""}: none), and an error (C{None}: none).
    """
    if state == _NIL:
        if c == "#":
            return _COMMENT, "", None
        if _is_space(c) or _is_newline(c):
            return _NIL, "", None
        return _NAME, c, None
    if state == _NAME:
        if _is_alpha(c):
            return _NAME, c, None
        if _is_space(c):
            return _VALUE, "", None
        return _NIL, "", _INVALID_COMMAND
    if state == _VALUE:
        if _is_newline(c) or _is_space(c):
            return _NIL, c, None
        return _VALUE, c, None
    if state == _PARAMETER:
        if _is_alpha(c) or _is_number(c) or c == "_":
            return _PARAMETER, c, None
        if _is_space(c):
            return _VALUE, "", None
        return _NIL, "", _UNEXPECTED_EOF
    if state == _MESSAGE:
        if _is_alpha(c):
            return _MESSAGE, c, None
        if _is_space(c):
            return _VALUE, "", None
        return _NIL, "", _UNEXPECTED_EOF
    # a comment
    if _is_newline(c):
        return _NIL, "", None
    return _COMMENT, "", None


def decode(data: bytes) -> str:
    """
    A Modelfile's bytes as its text: a UTF-8 or UTF-16 byte-order mark
    decides the encoding and is dropped (Ollama's C{BOMOverride}); bytes
    that are not UTF-8 become U+FFFD.
    """
    if data.startswith(b"\xef\xbb\xbf"):
        return data[3:].decode("utf-8", "replace")
    if data.startswith(b"\xff\xfe"):
        return data[2:].decode("utf-16-le", "replace")
    if data.startswith(b"\xfe\xff"):
        return data[2:].decode("utf-16-be", "replace")
    return data.decode("utf-8", "replace")


def parse(text: str) -> list[Command]:
    """
    Parse a Modelfile as Ollama's C{parser.ParseFile} does.

    @param text: The file's text (L{decode} for its bytes); a leading
        U+FEFF is dropped.
    @return: The commands, in order.
    @raise ModelfileError: What Ollama's parser says: C{(line N):
        command must be one of ...}, C{(line N): message role must be one
        of ...}, C{unexpected EOF[: what was read]}, C{no FROM line}.
    """
    text = text.removeprefix("\ufeff")
    commands: list[Command] = []
    name = ""
    role = ""
    state = _NIL
    line = 1
    buffer: list[str] = []
    for c in text:
        if _is_newline(c):
            line += 1
        following, kept, error = _next_state(c, state)
        if error == _UNEXPECTED_EOF:
            raise ModelfileError(f"{_UNEXPECTED_EOF}: {''.join(buffer)}")
        if error is not None:
            raise ModelfileError(f"(line {line}): {error}")
        if following != state:
            if state == _NAME:
                word = "".join(buffer)
                if word.lower() not in COMMANDS:
                    raise ModelfileError(f"(line {line}): {_INVALID_COMMAND}")
                lowered = word.lower()
                if lowered == "from":
                    name = "model"
                elif lowered == "parameter":
                    following = _PARAMETER
                elif lowered == "message":
                    following = _MESSAGE
                    name = lowered
                else:
                    name = lowered
            elif state == _PARAMETER:
                name = "".join(buffer)
            elif state == _MESSAGE:
                word = "".join(buffer)
                if word not in ROLES:
                    raise ModelfileError(f"(line {line}): {_INVALID_ROLE}")
                role = word
            elif state == _VALUE:
                value, closed = _unquote("".join(buffer).strip(" \t\r\n\v\f"))
                if not closed or _is_space(kept):
                    buffer.append(kept)  # (a space, or a line end inside quotes: part of the value)
                    continue
                if role:
                    value = f"{role}: {value}"
                    role = ""
                commands.append(Command(name, value))
            buffer = []
            state = following
        if kept and _is_print(kept):
            buffer.append(kept)
    if state == _VALUE:
        value, closed = _unquote("".join(buffer).strip(" \t\r\n\v\f"))
        if not closed:
            raise ModelfileError(_UNEXPECTED_EOF)
        commands.append(Command(name, f"{role}: {value}" if role else value))
    elif state not in (_NIL, _COMMENT):
        raise ModelfileError(_UNEXPECTED_EOF)
    if not any(command.name == "model" for command in commands):
        raise ModelfileError("no FROM line")
    return commands


def quote(value: str) -> str:
    """
    A value as Ollama's renderer writes it: as it is, unless it has a line
    end or a leading or trailing space; then in C{"..."}, or in
    C{\"\"\"...\"\"\"} when it holds a C{"}.
    """
    if "\n" in value or value.startswith(" ") or value.endswith(" "):
        if '"' in value:
            return f'"""{value}"""'
        return f'"{value}"'
    return value


def render_command(command: Command) -> str:
    """
    One command as a Modelfile line (Ollama's C{Command.String}).
    """
    if command.name == "model":
        return f"FROM {command.args}"
    if command.name in ("license", "template", "system", "adapter", "renderer", "parser", "requires", "draft"):
        return f"{command.name.upper()} {quote(command.args)}"
    if command.name == "message":
        role, _, content = command.args.partition(": ")
        return f"MESSAGE {role} {quote(content)}"
    return f"PARAMETER {command.name} {quote(command.args)}"


def render(commands: Iterable[Command]) -> str:
    """
    A Modelfile's text, one line per command (Ollama's
    C{Modelfile.String}).
    """
    return "".join(render_command(command) + "\n" for command in commands)


# -- parameters ---------------------------------------------------------------

INT, FLOAT, BOOL, STRINGS = "int", "float", "bool", "strings"

PARAMETERS: Mapping[str, str] = {
    # api.Options (runtime) and api.Runner (load time), by their JSON names
    "num_keep": INT,
    "seed": INT,
    "num_predict": INT,
    "top_k": INT,
    "top_p": FLOAT,
    "min_p": FLOAT,
    "typical_p": FLOAT,
    "repeat_last_n": INT,
    "temperature": FLOAT,
    "repeat_penalty": FLOAT,
    "presence_penalty": FLOAT,
    "frequency_penalty": FLOAT,
    "stop": STRINGS,
    "num_ctx": INT,
    "num_batch": INT,
    "num_gpu": INT,
    "main_gpu": INT,
    "use_mmap": BOOL,
    "num_thread": INT,
    "draft_num_predict": INT,
    # gone from Ollama's Options in 0.12, still llama.cpp's samplers: kept
    "mirostat": INT,
    "mirostat_tau": FLOAT,
    "mirostat_eta": FLOAT,
}
"""Every parameter a Modelfile may set, and its type."""

DEPRECATED = ("penalize_newline", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mlock")
"""Parameters Ollama accepts and drops (with a warning)."""

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_TRUE = ("1", "t", "T", "TRUE", "true", "True")
_FALSE = ("0", "f", "F", "FALSE", "false", "False")
_FLOAT32_MAX = 3.4028234663852886e38


def float32(value: float) -> float:
    """
    C{value} rounded to a float32, as the shortest decimal that reads back
    as that float32 (how Go writes a C{float32} in JSON: C{0.7}, not
    C{0.699999988079071}).
    """
    rounded = struct.unpack("f", struct.pack("f", value))[0]
    if rounded == 0 or not math.isfinite(rounded):
        return float(rounded)
    for digits in range(1, 10):
        text = f"{rounded:.{digits}g}"
        if struct.unpack("f", struct.pack("f", float(text)))[0] == rounded:
            return float(text)
    return float(rounded)  # pragma: no cover (9 digits always round-trip a float32)


def parameter_value(name: str, text: str) -> Any:
    """
    A Modelfile C{PARAMETER}'s value with its type (Ollama's
    C{FormatParams}): an C{int}, a C{float} (as a float32), a C{bool}, or
    for C{stop} the string.

    @raise ModelfileError: C{unknown parameter 'x'}, C{invalid int value
        [x]}, C{invalid float value [x]}, C{invalid bool value [x]}.
    """
    kind = PARAMETERS.get(name)
    if kind is None:
        raise ModelfileError(f"unknown parameter '{name}'")
    if kind == INT:
        if not _INT.fullmatch(text) or not -(2**63) <= int(text) < 2**63:
            raise ModelfileError(f"invalid int value [{text}]")
        return int(text)
    if kind == FLOAT:
        if not _FLOAT.fullmatch(text) or abs(float(text)) > _FLOAT32_MAX:
            raise ModelfileError(f"invalid float value [{text}]")
        return float32(float(text))
    if kind == BOOL:
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ModelfileError(f"invalid bool value [{text}]")
    return text


def check_parameters(parameters: Any) -> tuple[dict[str, Any], list[str]]:
    """
    A create request's C{parameters} object, checked and normalized:
    integers for integer parameters (a whole JSON number is one), floats
    for float ones, C{stop} always a list of strings.

    @return: The parameters (in their order), and the names of deprecated
        ones that were dropped (L{DEPRECATED}, as Ollama drops them).
    @raise ModelfileError: Not an object, an unknown name (C{unknown
        parameter 'x'}), or a value of the wrong type (naming it).
    """
    if parameters is None:
        return {}, []
    if not isinstance(parameters, dict):
        raise ModelfileError("parameters must be an object of parameter name -> value")
    out: dict[str, Any] = {}
    dropped: list[str] = []
    for name, value in parameters.items():
        if name in DEPRECATED:
            dropped.append(name)
            continue
        kind = PARAMETERS.get(name)
        if kind is None:
            raise ModelfileError(f"unknown parameter '{name}'")
        if value is None:
            continue
        if kind == INT:
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ModelfileError(f"parameter {name} must be an integer, got {value!r}")
        elif kind == FLOAT:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ModelfileError(f"parameter {name} must be a number, got {value!r}")
            value = float(value)
        elif kind == BOOL:
            if not isinstance(value, bool):
                raise ModelfileError(f"parameter {name} must be true or false, got {value!r}")
        else:
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ModelfileError(f"parameter {name} must be a string or an array of strings")
        out[name] = value
    return out, dropped


# -- Go's formatting, for what /api/show prints ------------------------------


def go_float(value: float) -> str:
    """
    A float64 as Go's C{%v} and C{%#v} write it (C{strconv}'s shortest
    C{%g}: the exponent form when the exponent is below -4 or at least 6):
    C{0.7}, C{4096}, C{1e+06}, C{1.5e-05}.
    """
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "-0" if math.copysign(1.0, value) < 0 else "0"
    shortest = decimal.Decimal(repr(value)).normalize()  # Python's repr is the shortest round trip too
    sign, digit_tuple, exponent = shortest.as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple))
    point = len(digits) + exponent  # where the decimal point falls in digits
    exp = point - 1
    head = "-" if sign else ""
    if exp < -4 or exp >= 6:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{head}{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    if point <= 0:
        return f"{head}0.{'0' * -point}{digits}"
    if point >= len(digits):
        return f"{head}{digits}{'0' * (point - len(digits))}"
    return f"{head}{digits[:point]}.{digits[point:]}"


def go_quote(text: str) -> str:
    """
    A string as Go's C{%#v} (C{strconv.Quote}) writes it.
    """
    out = ['"']
    for c in text:
        if c in ('"', "\\"):
            out.append("\\" + c)
        elif c in "\a\b\f\n\r\t\v":
            out.append({"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v"}[c])
        elif _is_print(c):
            out.append(c)
        elif ord(c) < 0x80:
            out.append(f"\\x{ord(c):02x}")
        elif ord(c) <= 0xFFFF:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(f"\\U{ord(c):08x}")
    out.append('"')
    return "".join(out)


def go_value(value: Any, verbose: bool) -> str:
    """
    A JSON-decoded value as Go's C{%#v} (C{verbose}) or C{%v} writes it, as
    Ollama decodes parameters: every number a float64.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return go_float(float(value))
    if isinstance(value, str):
        return go_quote(value) if verbose else value
    if value is None:
        return "<nil>"
    return strictjson.encode(value)


def parameter_lines(parameters: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """
    The parameters one value per line: a list (C{stop}) gives a line per
    item.
    """
    lines: list[tuple[str, Any]] = []
    for name, value in parameters.items():
        for item in value if isinstance(value, list) else [value]:
            lines.append((name, item))
    return lines


def show_parameters(parameters: Mapping[str, Any]) -> str:
    """
    C{/api/show}'s C{parameters}: C{name} padded to 30, a space, the value
    as Go's C{%#v} (strings quoted), one line per value.
    """
    return "\n".join(f"{name:<30} {go_value(value, True)}" for name, value in parameter_lines(parameters))


def go_json(value: Any, sort_keys: bool = True) -> bytes:
    """
    C{value} as Go's C{json.Encoder} writes it (what Ollama stores in a
    params or messages layer): a map's keys sorted (C{sort_keys}; a
    struct's fields are in their order, as C{value}'s), no spaces, C{<>&}
    and U+2028/U+2029 escaped, whole floats without a fraction, a newline
    at the end.
    """

    def whole(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer() and abs(v) < 1e21:
            return int(v)
        if isinstance(v, dict):
            return {k: whole(x) for k, x in v.items()}
        if isinstance(v, list):
            return [whole(x) for x in v]
        return v

    text = strictjson.encode(whole(value), separators=(",", ":"), sort_keys=sort_keys, ensure_ascii=False)
    for c, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(c, escaped)
    return (text + "\n").encode("utf-8")


# -- the Modelfile as a create request -----------------------------------------


@attrs.frozen
class CreateFields:
    """
    A Modelfile as the fields of a JSON create request (Ollama's
    C{Modelfile.CreateRequest}), for the legacy C{modelfile} form.

    @ivar source: C{FROM}'s model name, or L{None}.
    @ivar files: C{FROM @sha256:<hex>} (a blob uploaded first, as older
        clients sent it) as C{name -> digest}.
    @ivar adapters: C{ADAPTER @sha256:<hex>}, likewise.
    @ivar ignored: Commands Blazar accepts and does not honour (C{DRAFT},
        C{RENDERER}, C{PARSER}, C{REQUIRES}, deprecated parameters).
    """

    source: str | None = None
    files: Mapping[str, str] = attrs.field(factory=dict)
    adapters: Mapping[str, str] = attrs.field(factory=dict)
    template: str | None = None
    system: str | None = None
    license: tuple[str, ...] = ()
    parameters: Mapping[str, Any] = attrs.field(factory=dict)
    messages: tuple[Mapping[str, str], ...] = ()
    ignored: tuple[str, ...] = ()


_BLOB_REFERENCE = re.compile(r"@(sha256[:-][0-9a-fA-F]{64})")


def create_fields(commands: Iterable[Command]) -> CreateFields:
    """
    The create request a parsed Modelfile stands for. C{FROM} names a model
    or an uploaded blob (C{@sha256:<hex>}); a file path on the client's
    machine cannot be read here and is refused.

    @raise ModelfileError: A path in C{FROM} or C{ADAPTER}, or a bad
        C{PARAMETER}.
    """
    source: str | None = None
    files: dict[str, str] = {}
    adapters: dict[str, str] = {}
    template = system = None
    licenses: list[str] = []
    parameters: dict[str, Any] = {}
    messages: list[dict[str, str]] = []
    ignored: list[str] = []
    for command in commands:
        name, args = command.name, command.args
        if name in ("model", "adapter"):
            blob = _BLOB_REFERENCE.fullmatch(args)
            if blob is not None:
                digest = "sha256:" + blob[1][7:].lower()
                if name == "model":
                    files[f"model-{len(files)}.gguf" if files else "model.gguf"] = digest
                else:
                    adapters["adapter.gguf"] = digest
                continue
            if name == "adapter" or _looks_like_path(args):
                raise ModelfileError(
                    f"{'FROM' if name == 'model' else 'ADAPTER'} {args}: a file on the client's machine, which "
                    "Blazar cannot read; upload it first (POST /api/blobs/sha256:<hex>) and name it as "
                    "@sha256:<hex>, or send the JSON form with files/adapters"
                )
            source = args
        elif name == "template":
            template = args
        elif name == "system":
            system = args
        elif name == "license":
            licenses.append(args)
        elif name == "message":
            role, _, content = args.partition(": ")
            messages.append({"role": role, "content": content})
        elif name in ("draft", "renderer", "parser", "requires"):
            ignored.append(name.upper())
        elif name in DEPRECATED:
            ignored.append(f"PARAMETER {name}")
        else:
            value = parameter_value(name, args)
            if name == "stop":
                parameters.setdefault("stop", []).append(value)
            else:
                parameters[name] = value
    return CreateFields(
        source, files, adapters, template, system, tuple(licenses), parameters, tuple(messages), tuple(ignored)
    )


def _looks_like_path(text: str) -> bool:
    return (
        text.startswith(("/", "./", "../", "~", "\\"))
        or text.lower().endswith((".gguf", ".bin", ".safetensors"))
        or re.match(r"[A-Za-z]:[\\/]", text) is not None
    )


# -- a model's Modelfile, as /api/show renders it ----------------------------

DEFAULT_TEMPLATE = "{{ .Prompt }}"
"""The Go template Ollama gives a model without one."""


def model_commands(
    model: str,
    adapters: Iterable[str] = (),
    projectors: Iterable[str] = (),
    template: str | None = None,
    system: str | None = None,
    parameters: Mapping[str, Any] | None = None,
    license: Iterable[str] = (),
    messages: Iterable[Mapping[str, Any]] = (),
) -> list[Command]:
    """
    A model's Modelfile commands in Ollama's order (C{Model.String}):
    C{FROM} the model, its C{ADAPTER}s, a C{FROM} per projector,
    C{TEMPLATE} (Ollama's default when it has none), C{SYSTEM}, each
    C{PARAMETER} (a value per C{stop}), C{LICENSE}s, C{MESSAGE}s.
    """
    commands = [Command("model", model)]
    commands += [Command("adapter", a) for a in adapters]
    commands += [Command("model", p) for p in projectors]
    commands.append(Command("template", template if template is not None else DEFAULT_TEMPLATE))
    if system:
        commands.append(Command("system", system))
    commands += [Command(name, go_value(value, False)) for name, value in parameter_lines(parameters or {})]
    commands += [Command("license", text) for text in license]
    commands += [Command("message", f"{m.get('role', '')}: {m.get('content', '')}") for m in messages]
    return commands


def show_modelfile(short_name: str, commands: Iterable[Command]) -> str:
    """
    C{/api/show}'s C{modelfile}: Ollama's header, then the commands.
    """
    return (
        '# Modelfile generated by "ollama show"\n'
        "# To build a new Modelfile based on this, replace FROM with:\n"
        f"# FROM {short_name}\n\n" + render(commands)
    )


# -- a model's parameters as how it is run -------------------------------------


def _whole(value: Any, least: int) -> int | None:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= least else None


def model_settings(parameters: Mapping[str, Any], settings: ModelConfig | None = None) -> ModelConfig:
    """
    A model's load-time parameters (Ollama's C{Runner} options) as how its
    child is started: C{num_ctx} is the context per slot (C{ctx_size}),
    C{num_gpu} the layers on the GPU (C{gpu_layers}; -1, "all it can", is
    llama-server's own fit), C{main_gpu}, C{num_thread} (C{threads}),
    C{use_mmap}. What C{settings} (the operator's C{[models."name"]})
    sets wins; values of the wrong kind are left out.
    """
    base = settings or ModelConfig()
    use_mmap = parameters.get("use_mmap")
    return attrs.evolve(
        base,
        ctx_size=base.ctx_size if base.ctx_size is not None else _whole(parameters.get("num_ctx"), 1),
        gpu_layers=base.gpu_layers if base.gpu_layers is not None else _whole(parameters.get("num_gpu"), 0),
        main_gpu=base.main_gpu if base.main_gpu is not None else _whole(parameters.get("main_gpu"), 0),
        threads=base.threads if base.threads is not None else _whole(parameters.get("num_thread"), 1),
        use_mmap=base.use_mmap if base.use_mmap is not None else use_mmap if isinstance(use_mmap, bool) else None,
    )
