"""
Measuring a model's speed as a client sees it (C{blazar bench}, issue 38)
and comparing runs: prompt processing and generation tokens/s and the time
to the first token, from streamed chat completions, at one or more
concurrency levels.

What is measured, per request (L{Sample}, from the stream as it arrives,
L{StreamRecorder}):

  - I{TTFT}: from sending the request to the first chunk that carries
    generated text (content, reasoning or a tool call's fragment), in
    milliseconds; it includes waiting for a slot, the prompt's processing
    and the gateway's own work.
  - I{prompt processing tokens/s}: the prompt tokens the engine had to
    process (C{usage.prompt_tokens} less C{prompt_tokens_details.
    cached_tokens}) over the TTFT.
  - I{generation tokens/s}: C{usage.completion_tokens - 1} over the time
    from the first generated chunk to the last (the first token's time is
    the TTFT's).
  - the engine's own figures, where it reports them (llama-server's
    C{timings.prompt_per_second} and C{predicted_per_second}, on the last
    chunk), for comparison: they leave out the gateway and the queue.

Per level (L{Level}, L{summarise}): medians (and the TTFT's 90th
percentile) over its requests, and the aggregate generation throughput:
every completion token of the level over its wall time.

Every prompt starts with a salt of its own (L{synthetic_prompt}), so no
request reuses another's KV cache (llama-server's C{cache_prompt}) and the
prompt is processed for real; streams bypass the semantic cache.

The driver (L{run_bench}) is Twisted code over an injected HTTP client
(C{treq}'s interface; C{StubTreq} in tests) and clock; the arithmetic,
the history's comparison (L{compare}) and the engine gate's speed margin
(L{speed_refusal}) are pure.
"""

from __future__ import annotations

import json
import math
import secrets
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs
from twisted.internet.defer import Deferred, gatherResults

from blazar import strictjson
from blazar.engines.sse import SSEEvents
from blazar.httpbody import read_body, relay_body

#: metrics a level reports, with whether more is better (TTFT: less is)
METRICS: Mapping[str, bool] = {
    "gen_tps": True,
    "gen_tps_total": True,
    "pp_tps": True,
    "ttft_ms": False,
    "engine_gen_tps": True,
    "engine_pp_tps": True,
}
MAX_LEVELS = 16  # concurrency levels in one run
MAX_CONCURRENCY = 256  # streams at once in one level
IDLE_TIMEOUT = 300.0  # seconds a stream may stay silent (a model loading for the warm-up included)
MAX_STREAM_BYTES = 64 << 20  # one response, at most

# common English words: about one token each for the BPE vocabularies of real models
WORDS = (
    "the river carries light across a quiet valley where farmers plant grain and children walk to school "
    "under tall trees while old bridges hold the road above water that runs toward the sea past small "
    "towns with markets bakers and libraries full of maps letters songs and stories about travel weather "
    "mountains stars boats gardens kitchens music friends work rain snow summer winter morning evening"
).split()


class BenchFailed(Exception):
    """
    A run could not be measured: the warm-up failed, or every request of a
    level did; the message says what the gateway answered.
    """


def synthetic_prompt(tokens: int, salt: str) -> str:
    """
    A fixed text of about C{tokens} words (about as many tokens for a
    real model's vocabulary), after C{salt}: the salt comes first, so two
    prompts share no prefix an engine could reuse from its cache.
    """
    words = [WORDS[(i * 7 + 3) % len(WORDS)] for i in range(max(0, tokens))]
    return f"{salt}: write a long story that uses these words: " + " ".join(words)


def request_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """
    The streamed chat completion each request sends: usage asked for,
    greedy, and C{ignore_eos} (llama-server's) so that every answer is
    C{max_tokens} long and two runs decode as much.
    """
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "ignore_eos": True,
    }


@attrs.frozen
class Sample:
    """
    One request, as it was seen: times in seconds on the measuring clock.

    @ivar sent: When the request was sent.
    @ivar first: When the first generated text arrived (L{None}: none).
    @ivar last: When the last generated text arrived.
    @ivar done: When the response ended.
    @ivar prompt_tokens: C{usage.prompt_tokens} (L{None}: not reported).
    @ivar cached_tokens: Of those, taken from the engine's cache.
    @ivar completion_tokens: C{usage.completion_tokens}, else the chunks
        that carried text.
    @ivar engine_pp_tps: The engine's C{timings.prompt_per_second}.
    @ivar engine_gen_tps: The engine's C{timings.predicted_per_second}.
    @ivar error: Why it failed (L{None}: it did not).
    """

    sent: float
    first: float | None = None
    last: float | None = None
    done: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    engine_pp_tps: float | None = None
    engine_gen_tps: float | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        """
        Seconds to the first generated text.
        """
        return None if self.first is None else self.first - self.sent

    @property
    def pp_tps(self) -> float | None:
        """
        Prompt tokens processed (not cached) per second of TTFT.
        """
        ttft = self.ttft
        if self.prompt_tokens is None or not ttft or ttft <= 0:
            return None
        return max(0, self.prompt_tokens - self.cached_tokens) / ttft

    @property
    def gen_tps(self) -> float | None:
        """
        Tokens generated per second after the first one.
        """
        if self.first is None or self.last is None or self.completion_tokens < 2 or self.last <= self.first:
            return None
        return (self.completion_tokens - 1) / (self.last - self.first)


class StreamRecorder:
    """
    Reads one chat completion stream (Server-Sent Events, OpenAI's chunk
    shape) as its bytes arrive, and notes when generated text came, the
    usage and the engine's timings. C{now} is read at each event.
    """

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self._events = SSEEvents(self._event)
        self.first: float | None = None
        self.last: float | None = None
        self.chunks = 0
        self.usage: dict[str, Any] = {}
        self.timings: dict[str, Any] = {}
        self.error: str | None = None

    def feed(self, data: bytes) -> None:
        self._events.feed(data)

    def _event(self, payload: bytes) -> None:
        if payload.strip() == b"[DONE]":
            return
        at = self._now()
        try:
            chunk = json.loads(payload)
        except ValueError:
            self.error = self.error or f"not JSON in the stream: {payload[:200]!r}"
            return
        if not isinstance(chunk, dict):
            return
        if chunk.get("error") is not None:
            error = chunk["error"]
            self.error = self.error or str(error.get("message") if isinstance(error, dict) else error)[:500]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and (
                delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
            ):
                if self.first is None:
                    self.first = at
                self.last = at
                self.chunks += 1
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]

    def sample(self, sent: float, done: float) -> Sample:
        """
        The request as seen, once its stream ended at C{done}.
        """
        usage, timings = self.usage, self.timings
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        error, first, last = self.error, self.first, self.last
        generated = _count(usage.get("completion_tokens"))
        if first is None and generated:
            # tokens that are no text yet (a character's first bytes, a random-weight model's
            # special tokens): generated all the same; when the first came is unknown, so the end
            first = last = done
        if error is None and first is None:
            error = "the stream carried no generated text"
        return Sample(
            sent=sent,
            first=first,
            last=last,
            done=done,
            prompt_tokens=_count(usage.get("prompt_tokens")),
            cached_tokens=_count(cached) or 0,
            completion_tokens=generated or self.chunks,
            engine_pp_tps=_rate(timings.get("prompt_per_second")),
            engine_gen_tps=_rate(timings.get("predicted_per_second")),
            error=error,
        )


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _rate(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def percentile(values: Sequence[float], q: float) -> float | None:
    """
    The C{q}th percentile (0-100) of C{values}, interpolated between the
    two nearest ranks (NumPy's default, C{linear}); L{None} for none.
    """
    ordered = sorted(values)
    if not ordered:
        return None
    at = (len(ordered) - 1) * q / 100.0
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def _median(values: Iterable[float | None]) -> float | None:
    return percentile([v for v in values if v is not None], 50)


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


@attrs.frozen
class Level:
    """
    One concurrency level's result (L{summarise}); times in milliseconds,
    rates in tokens per second, L{None} where nothing measured it.

    @ivar concurrency: Streams at once.
    @ivar requests: Requests sent; C{errors} of them failed.
    @ivar prompt_tokens: Median prompt length, in tokens.
    @ivar completion_tokens: Tokens generated in all.
    @ivar ttft_ms: Median time to the first token; C{ttft_ms_p90}, its
        90th percentile.
    @ivar pp_tps: Median prompt processing rate per request.
    @ivar gen_tps: Median generation rate per stream.
    @ivar gen_tps_total: Every token generated at this level over its wall
        time (the throughput of all its streams together).
    @ivar wall_s: The level's wall time, in seconds.
    @ivar engine_pp_tps: Median of the engine's own prompt rate;
        C{engine_gen_tps}, of its generation rate.
    """

    concurrency: int
    requests: int
    errors: int
    prompt_tokens: int | None
    completion_tokens: int
    ttft_ms: float | None
    ttft_ms_p90: float | None
    pp_tps: float | None
    gen_tps: float | None
    gen_tps_total: float | None
    wall_s: float
    engine_pp_tps: float | None = None
    engine_gen_tps: float | None = None

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def summarise(concurrency: int, samples: Sequence[Sample], wall: float) -> Level:
    """
    A level's figures from its requests (the failed ones counted, not
    measured) and its wall time in seconds.
    """
    good = [s for s in samples if s.error is None]
    ttfts = [t * 1000.0 for s in good if (t := s.ttft) is not None]
    generated = sum(s.completion_tokens for s in good)
    prompt = _median(s.prompt_tokens for s in good)
    return Level(
        concurrency=concurrency,
        requests=len(samples),
        errors=len(samples) - len(good),
        prompt_tokens=None if prompt is None else int(round(prompt)),
        completion_tokens=generated,
        ttft_ms=_round(percentile(ttfts, 50)),
        ttft_ms_p90=_round(percentile(ttfts, 90)),
        pp_tps=_round(_median(s.pp_tps for s in good)),
        gen_tps=_round(_median(s.gen_tps for s in good)),
        gen_tps_total=_round(generated / wall) if good and wall > 0 else None,
        wall_s=round(wall, 3),
        engine_pp_tps=_round(_median(s.engine_pp_tps for s in good)),
        engine_gen_tps=_round(_median(s.engine_gen_tps for s in good)),
    )


# -- the run, through a gateway (or any OpenAI-compatible server) ------------------


async def stream_sample(
    http: Any,
    url: str,
    body: dict[str, Any],
    headers: Mapping[str, str],
    clock: Any,
    now: Callable[[], float],
    idle_timeout: float = IDLE_TIMEOUT,
) -> Sample:
    """
    Send one streamed chat completion and time it (L{StreamRecorder}). A
    refusal or a broken stream is a L{Sample} with its C{error}, never an
    exception.

    @param http: C{treq}'s interface (C{post(url, data=, headers=,
        unbuffered=True)}), over a connection pool of the caller's.
    @param clock: Times the idle bound (C{callLater}).
    @param now: The measuring clock, in seconds (monotonic).
    """
    sent = now()
    try:
        response = await http.post(
            url,
            data=strictjson.encode(body).encode("utf-8"),
            headers={"content-type": "application/json", **headers},
            unbuffered=True,
        )
    except Exception as e:
        return Sample(sent=sent, error=f"no answer from {url}: {e}")
    if response.code != 200:
        try:
            text = await read_body(response, clock, idle_timeout=idle_timeout, max_bytes=1 << 20)
            error = json.loads(text).get("error")
            message = error.get("message") if isinstance(error, dict) else error
        except Exception:
            message = None
        return Sample(sent=sent, done=now(), error=f"HTTP {response.code}: {message or 'no error message'}")
    recorder = StreamRecorder(now)
    try:
        await relay_body(response, recorder.feed, clock, idle_timeout=idle_timeout, max_bytes=MAX_STREAM_BYTES)
    except Exception as e:
        return attrs.evolve(recorder.sample(sent, now()), error=f"the stream broke: {e!r}")
    return recorder.sample(sent, now())


async def run_level(
    http: Any,
    url: str,
    model: str,
    concurrency: int,
    *,
    rounds: int,
    prompt_tokens: int,
    max_tokens: int,
    clock: Any,
    now: Callable[[], float],
    headers: Mapping[str, str] | None = None,
    salt: str = "",
) -> tuple[Level, str | None]:
    """
    C{concurrency} streams at once, each sending C{rounds} requests one
    after another, every prompt salted apart (L{synthetic_prompt}).

    @return: The level, and the first failed request's error (L{None}:
        none failed).
    """

    async def stream(n: int) -> list[Sample]:
        out = []
        for r in range(rounds):
            prompt = synthetic_prompt(prompt_tokens, f"{salt or secrets.token_hex(4)}-{concurrency}-{n}-{r}")
            out.append(
                await stream_sample(http, url, request_body(model, prompt, max_tokens), headers or {}, clock, now)
            )
        return out

    started = now()
    streams = await gatherResults([Deferred.fromCoroutine(stream(n)) for n in range(concurrency)], consumeErrors=True)
    wall = now() - started
    samples = [s for stream_samples in streams for s in stream_samples]
    return summarise(concurrency, samples, wall), next((s.error for s in samples if s.error is not None), None)


async def run_bench(
    http: Any,
    url: str,
    model: str,
    levels: Sequence[int],
    *,
    rounds: int,
    prompt_tokens: int,
    max_tokens: int,
    clock: Any,
    now: Callable[[], float],
    headers: Mapping[str, str] | None = None,
    say: Callable[[Level], None] = lambda _: None,
) -> list[Level]:
    """
    A warm-up request (it loads the model if it is not loaded; not
    measured), then each level of C{levels} in turn (L{run_level}).

    @param say: Called with each level as it is done.
    @raise BenchFailed: The warm-up failed, or every request of a level.
    """
    salt = secrets.token_hex(4)
    warm = await stream_sample(
        http, url, request_body(model, synthetic_prompt(8, f"{salt}-warm-up"), 2), headers or {}, clock, now
    )
    if warm.error is not None:
        raise BenchFailed(f"the warm-up request failed: {warm.error}")
    results = []
    for concurrency in levels:
        level, error = await run_level(
            http,
            url,
            model,
            concurrency,
            rounds=rounds,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            clock=clock,
            now=now,
            headers=headers,
            salt=salt,
        )
        if level.errors == level.requests:
            raise BenchFailed(f"every request at concurrency {concurrency} failed, the first with: {error}")
        say(level)
        results.append(level)
    return results


def check_run(run: Any) -> dict[str, Any]:
    """
    A run as C{blazar bench} sends it to be recorded (C{{"settings":
    {...}, "levels": [Level.to_json(), ...]}}), checked.

    @raise ValueError: It is not one; the message says what is wrong.
    """
    if (
        not isinstance(run, dict)
        or not isinstance(run.get("settings"), dict)
        or not isinstance(run.get("levels"), list)
    ):
        raise ValueError('a run is {"settings": {...}, "levels": [...]}')
    levels = run["levels"]
    if not 1 <= len(levels) <= MAX_LEVELS:
        raise ValueError(f"a run has 1 to {MAX_LEVELS} levels, not {len(levels)}")
    fields = {f.name for f in attrs.fields(Level)}
    checked = []
    for level in levels:
        if not isinstance(level, dict) or set(level) != fields:
            raise ValueError(f"a level has the fields {', '.join(sorted(fields))}")
        for name, value in level.items():
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            ):
                raise ValueError(f"level field {name}: {value!r} is not a number of 0 or more")
        if not isinstance(level["concurrency"], int) or not 1 <= level["concurrency"] <= MAX_CONCURRENCY:
            raise ValueError(f"concurrency is 1 to {MAX_CONCURRENCY}")
        checked.append(level)
    settings = run["settings"]
    for key in ("prompt_tokens", "max_tokens", "rounds"):
        value = settings.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"settings.{key}: {value!r} is not a whole number of 0 or more")
    concurrency = settings.get("concurrency")
    if (
        not isinstance(concurrency, list)
        or not all(isinstance(c, int) and not isinstance(c, bool) for c in concurrency)
        or len(concurrency) > MAX_LEVELS
    ):
        raise ValueError(f"settings.concurrency: a list of at most {MAX_LEVELS} whole numbers")
    url = settings.get("url", "")
    if not isinstance(url, str) or len(url) > 2000:
        raise ValueError("settings.url: the URL the requests went to")
    kept = {key: settings[key] for key in ("prompt_tokens", "max_tokens", "rounds")}
    return {"settings": {**kept, "concurrency": concurrency, "url": url}, "levels": checked}


# -- comparing runs -----------------------------------------------------------------


def delta_percent(before: float | None, after: float | None) -> float | None:
    """
    C{after}'s change over C{before}, in percent (L{None} if either is
    missing or C{before} is 0).
    """
    if before is None or after is None or before == 0:
        return None
    return round((after - before) / before * 100.0, 1)


def flags(argv: Sequence[str]) -> dict[str, str]:
    """
    A command line's flags and their values (C{"-ngl": "99"}; a flag
    without a value: C{""}), the binary left out; a flag given twice
    keeps its last value, as llama.cpp does.
    """
    out: dict[str, str] = {}
    args = list(argv[1:])
    for i, arg in enumerate(args):
        if arg.startswith("-") and not _number(arg):
            following = args[i + 1] if i + 1 < len(args) else None
            out[arg] = (
                following if following is not None and (not following.startswith("-") or _number(following)) else ""
            )
    return out


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """
    What differs between two recorded runs besides their figures, in
    words: the engine, the launch profile's flags, the hardware, the
    bench settings.
    """
    out = []
    if before.get("engine") != after.get("engine"):
        out.append(f"engine: {before.get('engine')} -> {after.get('engine')}")
    old = flags((before.get("profile") or {}).get("argv") or [])
    new = flags((after.get("profile") or {}).get("argv") or [])
    for flag in sorted({*old, *new}):
        if old.get(flag) != new.get(flag):
            out.append(
                f"profile: {flag} {old.get(flag, '(unset)') or '(set)'} -> {new.get(flag, '(unset)') or '(set)'}"
            )
    if before.get("hardware") != after.get("hardware"):
        out.append("hardware: changed")
    old_settings, new_settings = before.get("settings") or {}, after.get("settings") or {}
    for key in ("prompt_tokens", "max_tokens", "rounds"):
        if old_settings.get(key) != new_settings.get(key):
            out.append(f"settings: {key} {old_settings.get(key)} -> {new_settings.get(key)}")
    return out


def compare(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """
    Two recorded runs of a model side by side: what changed between them
    (L{changes}) and, for each concurrency level both measured, each
    metric of L{METRICS} before and after with its change in percent.

    @return: C{{"before": id, "after": id, "changes": [...], "levels":
        [{"concurrency": N, "gen_tps": {"before", "after",
        "delta_percent"}, ...}]}}.
    """
    old = {level["concurrency"]: level for level in before.get("levels") or []}
    levels = []
    for level in after.get("levels") or []:
        previous = old.get(level["concurrency"])
        if previous is None:
            continue
        row: dict[str, Any] = {"concurrency": level["concurrency"]}
        for metric in METRICS:
            row[metric] = {
                "before": previous.get(metric),
                "after": level.get(metric),
                "delta_percent": delta_percent(previous.get(metric), level.get(metric)),
            }
        levels.append(row)
    return {"before": before.get("id"), "after": after.get("id"), "changes": changes(before, after), "levels": levels}


# -- the engine gate's speed margin ---------------------------------------------------


def slowdown(active_tps: float, candidate_tps: float) -> float:
    """
    How much slower the candidate decodes than the active engine, as a
    fraction of the active one's rate (negative: faster).
    """
    return 1.0 - candidate_tps / active_tps if active_tps > 0 else 0.0


def speed_refusal(active_tps: float, candidate_tps: float, max_slowdown: float) -> str | None:
    """
    Why the regression gate refuses a candidate engine that decodes more
    slowly than the active one by more than C{max_slowdown} (a fraction:
    C{0.10} allows 10 %), or L{None} if it may pass. C{max_slowdown} 0
    turns the check off.
    """
    if max_slowdown <= 0:
        return None
    slower = slowdown(active_tps, candidate_tps)
    if slower <= max_slowdown:
        return None
    return (
        f"it decodes {candidate_tps:.1f} tokens/s where the engine in use decodes {active_tps:.1f} "
        f"({slower * 100:.1f} % slower; [engines] gate_max_slowdown = {max_slowdown:g} allows "
        f"{max_slowdown * 100:g} %). Keep the engine in use, or raise gate_max_slowdown in the config "
        "(0 turns the speed check off) to switch anyway"
    )


# -- as text (blazar bench) ------------------------------------------------------------

LEVEL_HEADER = (
    f"{'CONC':>4} {'REQS':>5} {'ERRS':>4} {'PROMPT':>6} {'TTFT p50':>9} {'TTFT p90':>9} "
    f"{'PP tok/s':>9} {'GEN tok/s':>9} {'ALL tok/s':>9} {'ENG PP':>9} {'ENG GEN':>9}"
)


def _figure(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:.0f}{unit}" if unit == " ms" else f"{value:.1f}{unit}"


def level_line(level: Mapping[str, Any]) -> str:
    """
    One level (L{Level.to_json}) as a row under L{LEVEL_HEADER}.
    """
    return (
        f"{level['concurrency']:>4} {level['requests']:>5} {level['errors']:>4} "
        f"{_figure(level.get('prompt_tokens')).removesuffix('.0'):>6} "
        f"{_figure(level.get('ttft_ms'), ' ms'):>9} {_figure(level.get('ttft_ms_p90'), ' ms'):>9} "
        f"{_figure(level.get('pp_tps')):>9} {_figure(level.get('gen_tps')):>9} "
        f"{_figure(level.get('gen_tps_total')):>9} {_figure(level.get('engine_pp_tps')):>9} "
        f"{_figure(level.get('engine_gen_tps')):>9}"
    )


def hardware_text(hardware: Mapping[str, Any]) -> str:
    """
    A run's hardware in one line: CPU, RAM and each GPU.
    """
    if not hardware:
        return "not read"
    gpus = (
        "; ".join(
            f"GPU {g['index']} {g['name']} {g['memory_total'] / 2**30:.0f} GiB" for g in hardware.get("gpus") or ()
        )
        or "no GPU"
    )
    return (
        f"{hardware.get('cpu_physical_cores')} CPU cores ({hardware.get('cpu_logical_cores')} threads), "
        f"{(hardware.get('ram_total') or 0) / 2**30:.1f} GiB RAM, {gpus}"
    )


def profile_text(profile: Mapping[str, Any]) -> str:
    """
    A run's launch profile in one line: the child's flags (the binary and
    the model's path left out) and the GPUs it was placed on.
    """
    if "remote" in profile:
        return f"remote {profile['remote']} (model {profile.get('model')})"
    args = list(profile.get("argv") or [])[1:]
    if "-m" in args:
        at = args.index("-m")
        del args[at : at + 2]
    gpus = profile.get("gpus") or []
    return " ".join(args) + (f"  [GPUs {','.join(map(str, gpus))}, {profile.get('gpu_layers')} layers]" if gpus else "")


def run_line(run: Mapping[str, Any]) -> str:
    """
    A recorded run in one line: id, time (local), engine, settings and
    each level's generation rate and TTFT.
    """
    import time

    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(run["created"]))
    settings = run.get("settings") or {}
    levels = " | ".join(
        f"c{lv['concurrency']}: {_figure(lv.get('gen_tps'))} tok/s, {_figure(lv.get('ttft_ms'), ' ms')}"
        for lv in run.get("levels") or ()
    )
    return (
        f"{run['id']:>5}  {when}  {run['engine']:<30} prompt {settings.get('prompt_tokens')}, "
        f"max {settings.get('max_tokens')}:  {levels}"
    )


_SHOWN = (("gen_tps", "GEN tok/s"), ("gen_tps_total", "ALL tok/s"), ("pp_tps", "PP tok/s"), ("ttft_ms", "TTFT p50"))


def comparison_lines(comparison: Mapping[str, Any]) -> list[str]:
    """
    L{compare}'s result for people: what changed, then per level each
    metric before and after with its change in percent.
    """
    lines = [f"run {comparison['after']} against run {comparison['before']}:"]
    lines += [f"  {change}" for change in comparison["changes"]] or ["  same engine, profile, hardware and settings"]
    if not comparison["levels"]:
        return lines + ["  no concurrency level in common"]
    lines.append("  " + f"{'CONC':>4}  " + "  ".join(f"{title:<26}" for _, title in _SHOWN).rstrip())
    for level in comparison["levels"]:
        cells = []
        for metric, _ in _SHOWN:
            figures = level[metric]
            unit = " ms" if metric == "ttft_ms" else ""
            delta = figures["delta_percent"]
            cell = f"{_figure(figures['before'], unit)} -> {_figure(figures['after'], unit)}"
            cells.append(f"{cell + ('' if delta is None else f' ({delta:+.1f} %)'):<26}")
        lines.append("  " + f"{level['concurrency']:>4}  " + "  ".join(cells).rstrip())
    return lines
