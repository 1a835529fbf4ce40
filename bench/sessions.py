"""
The sessions scenario (issue 20): conversations taking turns round-robin
on a 2-slot model, 5 turns each, the whole history sent every turn as
agents do; prompt tokens the engine had to evaluate, the share that came
from the KV cache, and wall time.

    ./dev.sh bench --only sessions

Rows, each with conversations of their own (no row reuses another's
cache):
  - llama-server direct: the child itself, its own host-memory prompt cache;
  - Blazar, sessions (x-blazar-session): each conversation pinned to a slot,
    slots paged to the KV bank and back;
  - Blazar, sessions, the model evicted after every round: the bank restores
    each conversation into the new child;
  - Blazar, no session names, evicted after every round: what a restart
    costs without the bank (every turn prefilled again).
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from run import Bench

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
    "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()
TURNS = 5


def chat(port: int, key: str | None, messages: list[dict[str, str]], session: str | None) -> dict[str, Any]:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    if session:
        headers["x-blazar-session"] = session
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(
                {
                    "model": "two",
                    "messages": messages,
                    "max_tokens": 8,
                    "temperature": 0,
                    "seed": 1,
                }
            ),
            headers,
        )
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise SystemExit(f"sessions scenario: {resp.status} {body[:500]!r}")
        return json.loads(body)  # type: ignore[no-any-return]
    finally:
        conn.close()


def conversations(
    bench: Bench, first: int, count: int, port: Any, key: str | None, named: bool, evict: bool
) -> dict[str, float]:
    """
    C{count} conversations, numbered from C{first}, C{TURNS} turns each;
    C{port()} is where to send (it changes after an evict, for direct).
    """
    talks = []
    for n in range(first, first + count):
        system = f"You are assistant number {n}. " + " ".join(WORDS[(n * 7 + i) % len(WORDS)] for i in range(300))
        talks.append((f"bench-{n}" if named else None, [{"role": "system", "content": system}]))
    prompt = cached = 0
    started = time.monotonic()
    for turn in range(TURNS):
        for session, messages in talks:
            messages.append({"role": "user", "content": f"Turn {turn}: " + " ".join(WORDS[turn : turn + 5])})
            reply = chat(port(), key, messages, session)
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
            usage = reply["usage"]
            if turn > 0:
                prompt += usage["prompt_tokens"]
                cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if evict and turn < TURNS - 1:
            out = subprocess.run(
                [str(Path(sys.executable).parent / "blazar"), "evict", "two", "-c", str(bench.config)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if out.returncode != 0:
                raise SystemExit(f"blazar evict two: {out.stdout}{out.stderr}")
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "evaluated_tokens": prompt - cached,
        "cached_share": cached / prompt if prompt else 0.0,
        "wall_s": time.monotonic() - started,
    }


def sessions_scenario(bench: Bench) -> None:
    _, engine_port = bench.child("two")
    key = bench.engine_key
    results: dict[str, Any] = {"turns": TURNS, "slots": 2}
    first = 0
    for count in (8, 32):
        rows: dict[str, Any] = {}
        for name, port, row_key, named, evict in (
            ("llama-server direct", lambda: engine_port, key, False, False),
            ("Blazar, sessions", lambda: bench.port, None, True, False),
            ("Blazar, sessions, evicted every round", lambda: bench.port, None, True, True),
            ("Blazar, no session names, evicted every round", lambda: bench.port, None, False, True),
        ):
            if name == "llama-server direct":
                # the child Blazar runs now (an earlier row may have evicted it)
                _, engine_port = bench.child("two")
                key = bench.engine_key
                row_key = key
            rows[name] = conversations(bench, first, count, port, row_key, named, evict)
            first += count
        results[str(count)] = rows
    bench.results["sessions"] = results


def sessions_table(r: dict[str, Any]) -> str:
    lines = [
        f"Sessions: conversations round-robin on a 2-slot model, {r['turns']} turns each "
        "(figures over every turn after each conversation's first)",
        f"{'conversations':>13}  {'target':<48} {'evaluated':>10} {'from cache':>10} {'wall':>8}",
    ]
    for count in ("8", "32"):
        for name, row in r[count].items():
            lines.append(
                f"{count:>13}  {name:<48} {row['evaluated_tokens']:>10,} {row['cached_share']:>9.1%} "
                f"{row['wall_s']:>7.1f}s"
            )
    return "\n".join(lines)
