"""
C{speculative = "auto"} on the real llama-server with a real model
(SmolLM2-135M-Instruct, from its wheel): free-prose chat requests, one at
a time, until the tuner has decided (C{speculative_window = 3}: three
answers with n-gram lookup, an idle reload, three without; every other
request streamed, each answer counted); the decision
is logged with its figures, C{/api/ps} shows it, and after the next idle
reload the child's argv (its C{/proc/PID/cmdline}) matches it.

Prose gives n-gram lookup little to draft, and on this CPU it measured no
gain (docs/speculative.md), so the decision is expected to be C{off}; the
test does not insist (the machine's load moves the rates), it holds the
decision to its figures: the setting kept decodes, by the tuner's own
rates, at least as fast as without lookup (kept on only when >= 5% faster,
so the tolerance is the margin itself: a prose workload under C{auto} is
never left on a setting that measured slower than C{off}).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from blazar.engines.spectune import MARGIN, MIN_TOKENS
from tests.integration.harness import Daemon, real_model

MODEL = "smollm:latest"
WINDOW = 3
PROSE = [
    "Write a few sentences about a walk in an autumn forest.",
    "Describe a busy harbour town at dawn.",
    "Tell a short story about a lighthouse keeper and a storm.",
    "Describe the taste of a fresh summer strawberry to someone who never had one.",
    "Write a short letter to a friend about a trip to the mountains.",
    "Describe an old library on a rainy afternoon.",
]


def spec(daemon: Daemon) -> dict[str, Any]:
    """
    C{smollm}'s C{speculative} object in C{/api/ps}; C{{}} while no child
    of it is listed (between the two children of an idle reload).
    """
    status, _, raw = daemon.request("GET", "/api/ps")
    assert status == 200, raw
    rows = [m for m in json.loads(raw)["models"] if m["name"] == MODEL]
    return dict(rows[0]["speculative"]) if rows else {}


def listed(daemon: Daemon) -> dict[str, Any]:
    """
    L{spec} once a child is listed (waiting out an idle reload).
    """
    deadline = time.monotonic() + 30
    while not (shown := spec(daemon)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert shown, "no child of the model listed in /api/ps"
    return shown


def test_auto_decides_from_prose_and_the_reload_applies_it(engine: str, tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smollm.gguf").symlink_to(real_model())
    daemon = Daemon(
        tmp_path,
        f'models_dir = "{tmp_path / "models"}"\n[engines.llamacpp]\nbinary = "{engine}"\n'
        '[models."smollm"]\nparallel = 1\nctx_size = 2048\nthreads = 1\n'
        f'speculative = "auto"\nspeculative_window = {WINDOW}\n',
    ).start()
    try:
        asked, counted = 0, 0
        while True:
            body = {
                "model": "smollm",
                "messages": [{"role": "user", "content": PROSE[asked % len(PROSE)]}],
                "temperature": 0,
                "max_tokens": 96,
            }
            if asked % 2:  # every other one streamed: the timings ride on its last chunk
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                chunks = [json.loads(p) for p, _ in daemon.stream("/v1/chat/completions", body) if p != "[DONE]"]
                tokens = next(c["usage"]["completion_tokens"] for c in chunks if c.get("usage"))
            else:
                status, answer = daemon.post_json("/v1/chat/completions", body, timeout=120)
                assert status == 200, answer
                tokens = answer["usage"]["completion_tokens"]
            asked += 1
            counted += tokens >= MIN_TOKENS
            if asked == 1:
                argv = daemon.engine_for(MODEL).cmdline()
                assert argv[argv.index("--spec-type") + 1] == "ngram-mod,ngram-cache", (
                    argv
                )  # a trial starts with lookup
                assert listed(daemon)["decided"] == "measuring"
            shown = listed(daemon)
            if shown["decided"] != "measuring" or asked >= 6 * WINDOW:
                break
            time.sleep(1.5)  # the reaper's idle reload (checked each second) gets its turn between requests
        # every answer, streamed or not, was measured but those under MIN_TOKENS and the first of
        # each of the two children (warming up): at most two fewer than counted
        rates = shown["rates"]["interactive"]
        assert counted - 2 <= rates["on_n"] + rates["off_n"] < counted, (asked, counted, shown)
        assert shown["mode"] == "auto"
        assert shown["decided"] in ("on", "off"), (asked, shown, daemon.log()[-3000:])
        last = shown["last"]
        figures = last["classes"]["interactive"]
        assert figures["on_n"] >= WINDOW and figures["off_n"] >= WINDOW, last
        assert daemon.logged("speculative auto decided " + shown["decided"]) == 1
        line = next(x for x in daemon.log().splitlines() if "speculative auto decided" in x)
        assert f"{figures['on']:.1f} tok/s with lookup ({figures['on_n']} answers)" in line, line
        assert f"vs {figures['off']:.1f} without ({figures['off_n']})" in line, line
        assert f">= {1 + MARGIN:.2f}" in line, line
        # not slower than off, by the tuner's own rates: kept on only when >= 5% faster
        kept = figures["on"] if shown["decided"] == "on" else figures["off"]
        assert kept >= figures["off"], last
        # the next idle reload applies it: the child's argv follows the decision
        deadline = time.monotonic() + 30
        while spec(daemon).get("running") != shown["decided"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert spec(daemon).get("running") == shown["decided"], spec(daemon)
        status, body = daemon.post_json(
            "/v1/chat/completions",
            {"model": "smollm", "messages": [{"role": "user", "content": PROSE[0]}], "max_tokens": 32},
            timeout=120,
        )
        assert status == 200, body
        argv = daemon.engine_for(MODEL).cmdline()
        assert ("--spec-type" in argv) == (shown["decided"] == "on"), argv
        assert listed(daemon)["decided"] == shown["decided"]
    finally:
        daemon.close(check_engines=True)
