"""
The regression gate an engine passes before it becomes the active one
(issue 22): on models generated here (random weights), the candidate
llama-server must start and answer C{/health}, a chat completion, a
stream and an embedding. The first step that fails names what went
wrong, with the end of the engine's stderr. With a speed margin
(C{[engines] gate_max_slowdown}, issue 38) and an engine in use to compare
with, the candidate must also decode the generated chat model no more than
that much slower than the engine in use (L{SPEED}: the step C{speed}),
timed as C{blazar bench} times a stream (L{blazar.engines.bench}).

Blocking (processes, HTTP on loopback): the CLI calls it directly.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

from blazar import strictjson
from blazar.engines.bench import StreamRecorder, request_body, speed_refusal, synthetic_prompt
from blazar.engines.build import SOURCES
from blazar.models.testmodel import make_test_model

STEPS = ("start", "health", "chat", "stream", "embedding")
SPEED = "speed"  # the step after STEPS when a speed margin is set and there is an engine to compare with
START_TIMEOUT = 60.0
REQUEST_TIMEOUT = 60.0
SPEED_TOKENS = 64  # tokens each timed stream decodes (ignore_eos: all of them)
SPEED_ROUNDS = 3  # timed streams per engine, alternating; each engine's best counts


class GateFailed(Exception):
    """
    A step of the gate failed: C{step} (one of L{STEPS}) and C{detail}.
    """

    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"the regression gate failed at {step!r}: {detail}")
        self.step = step
        self.detail = detail


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Child:
    def __init__(self, binary: Path, model: Path, workdir: Path, extra: list[str]) -> None:
        self.port = _free_port()
        self.stderr = open(workdir / f"stderr-{self.port}.log", "w+b")
        argv = [
            str(binary),
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--jinja",
            "-np",
            "1",
            "-c",
            "512",
            "--threads",
            "1",
            *extra,
        ]
        try:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.stderr, stderr=self.stderr)
        except OSError as e:
            raise GateFailed("start", f"{binary} could not be run: {e}") from None

    def tail(self) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        lines = self.stderr.read().decode("utf-8", "replace").strip().splitlines()
        return " | ".join(lines[-3:]) or "no output"

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise GateFailed("start", f"the engine exited with code {code}: {self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.HTTPError):
                pass
            time.sleep(0.1)
        raise GateFailed("health", f"/health did not answer 200 within {timeout:g} s: {self.tail()}")

    def post(self, step: str, path: str, body: dict[str, object]) -> bytes:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            strictjson.encode(body).encode(),
            {"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as r:
                return bytes(r.read())
        except urllib.error.HTTPError as e:
            raise GateFailed(step, f"{path} answered {e.code}: {e.read()[:300]!r}") from None
        except OSError as e:
            raise GateFailed(step, f"{path} failed: {e}; {self.tail()}") from None

    def decode_speed(self, tokens: int = SPEED_TOKENS) -> float:
        """
        Tokens/s after the first of one streamed chat completion of
        C{tokens} tokens, timed as C{blazar bench} times one
        (L{blazar.engines.bench.StreamRecorder}); the engine's own figure
        where the stream's chunks cannot time it (a random-weight model's
        byte tokens may come in one chunk: llama-server holds back
        incomplete UTF-8).

        @raise GateFailed: At step L{SPEED}: it failed, or gave no rate.
        """
        body = request_body("gate", synthetic_prompt(16, f"gate-{time.monotonic_ns()}"), tokens)
        body.pop("stream_options")  # (llama-server sends its usage and timings on a stream's last chunk anyway)
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            strictjson.encode(body).encode(),
            {"content-type": "application/json"},
        )
        recorder = StreamRecorder(time.perf_counter)
        sent = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as r:
                while chunk := r.read1(65536):
                    recorder.feed(chunk)
        except urllib.error.HTTPError as e:
            raise GateFailed(SPEED, f"a timed stream answered {e.code}: {e.read()[:300]!r}") from None
        except OSError as e:
            raise GateFailed(SPEED, f"a timed stream failed: {e}; {self.tail()}") from None
        sample = recorder.sample(sent, time.perf_counter())
        rate = sample.gen_tps if sample.gen_tps is not None else sample.engine_gen_tps
        if sample.error is not None or rate is None:
            raise GateFailed(SPEED, f"a timed stream gave no decode rate: {sample.error or 'too few tokens'}")
        return rate

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.stderr.close()


@contextlib.contextmanager
def _children(binary: Path, workdir: Path) -> Iterator[Callable[..., _Child]]:
    started: list[_Child] = []

    def start(model: Path, extra: list[str], other: Path | None = None) -> _Child:
        child = _Child(other or binary, model, workdir, extra)
        started.append(child)
        return child

    try:
        yield start
    finally:
        for child in started:
            child.stop()


def thd_gate(
    binary: Path,
    say: Callable[[str], None] = lambda _: None,
    *,
    baseline: Path | None = None,
    max_slowdown: float = 0.0,
) -> list[str]:
    """
    Run the gate on C{binary}; the steps passed (all of L{STEPS}, then
    L{SPEED} if it ran).

    @param baseline: The engine in use, to compare the candidate's speed
        with (L{None}: none to compare with, no speed step).
    @param max_slowdown: C{[engines] gate_max_slowdown}: how much slower
        than C{baseline} the candidate may decode, a fraction (0: no speed
        step).
    @raise GateFailed: A step failed.
    """
    with tempfile.TemporaryDirectory(prefix="blazar-gate-") as tmp:
        workdir = Path(tmp)
        chat_model = make_test_model(workdir / "chat.gguf").path
        embed_model = make_test_model(workdir / "embed.gguf", seed=1, embedding=True).path
        passed: list[str] = []
        with _children(binary, workdir) as start:
            chat = start(Path(chat_model), [])
            passed.append("start")
            chat.wait_healthy(START_TIMEOUT)
            passed.append("health")
            say("gate: started, /health 200")
            reply = json.loads(
                chat.post(
                    "chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                )
            )
            if not isinstance(reply.get("choices"), list) or not reply["choices"]:
                raise GateFailed("chat", f"no choices in the answer: {str(reply)[:200]}")
            passed.append("chat")
            events = chat.post(
                "stream",
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
            )
            if not events.rstrip().endswith(b"data: [DONE]"):
                raise GateFailed("stream", f"the stream did not end with [DONE]: {events[-200:]!r}")
            passed.append("stream")
            say("gate: chat completion and stream answered")
            embedder = start(Path(embed_model), ["--embeddings", "--pooling", "mean"])
            embedder.wait_healthy(START_TIMEOUT)
            vectors = json.loads(embedder.post("embedding", "/v1/embeddings", {"input": "hello"}))
            data = vectors.get("data") if isinstance(vectors, dict) else None
            if not (isinstance(data, list) and data and isinstance(data[0].get("embedding"), list)):
                raise GateFailed("embedding", f"no embedding in the answer: {str(vectors)[:200]}")
            passed.append("embedding")
            say("gate: embedding answered")
            if baseline is not None and max_slowdown > 0:
                active = start(Path(chat_model), [], baseline)
                active.wait_healthy(START_TIMEOUT)
                candidate_tps, active_tps = thd_compare_speed(chat, active)
                refusal = speed_refusal(active_tps, candidate_tps, max_slowdown)
                if refusal is not None:
                    raise GateFailed(SPEED, refusal)
                passed.append(SPEED)
                say(
                    f"gate: decodes {candidate_tps:.1f} tokens/s, the engine in use {active_tps:.1f} "
                    f"(gate_max_slowdown = {max_slowdown:g})"
                )
        return passed


def thd_compare_speed(candidate: _Child, active: _Child, rounds: int = SPEED_ROUNDS) -> tuple[float, float]:
    """
    The best decode rate of each of two children serving the same model
    over C{rounds} timed streams each, taken in turns (so that a machine
    that gets busier meanwhile slows both alike); a first untimed stream
    each warms them up.

    @return: C{(candidate's tokens/s, active's tokens/s)}.
    """
    candidate.decode_speed(4)
    active.decode_speed(4)
    best = [0.0, 0.0]
    for _ in range(rounds):
        best[0] = max(best[0], candidate.decode_speed())
        best[1] = max(best[1], active.decode_speed())
    return best[0], best[1]


def thd_probe(kind: str, binary: Path) -> None:
    """
    The gate of an engine that serves no model yet (C{whisper},
    C{sdcpp}): the binary runs here and answers its help (exit 0).

    @raise GateFailed: It does not.
    """
    try:
        done = subprocess.run([str(binary), SOURCES[kind].probe], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise GateFailed("start", f"{binary} does not run here: {e}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).decode("utf-8", "replace").strip().splitlines()[-3:]
        raise GateFailed("start", f"{binary} {SOURCES[kind].probe} exited {done.returncode}: {' / '.join(tail)}")
