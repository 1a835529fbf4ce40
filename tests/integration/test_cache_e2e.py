"""
The semantic cache end to end (issue 26, point 2): one real daemon with
real llama-server children (a generated chat model and a generated
embedding model), driven with the official openai SDK.

Whether the engine answered is read from the chat child itself: its own
C{llamacpp:tokens_predicted_total} (llama-server's C{--metrics}) grows with
every token it generates, so a hit, which must not reach it, leaves it
where it was, and a miss moves it.

A random-weight model rarely ends an answer by itself, and an answer cut
at C{max_tokens} is one the sentinel flags (C{truncated}), which the cache
never stores. So each prompt's greedy answer is probed first, and the
cached requests carry a stop sequence taken from inside it: the answer
then ends cleanly (C{finish_reason} stop) with text before it.
"""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from blazar.models.testmodel import GeneratedModel
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon

KEY_A = "cache-key-a-0123456789abcdef"
KEY_B = "cache-key-b-0123456789abcdef"
TTL = 5  # seconds
# identical prompts embed identically; anything else must fall below this
THRESHOLD = 0.9999
MODEL = "tiny:latest"


@pytest.fixture(scope="module")
def daemon(
    engine: str,
    models: dict[str, GeneratedModel],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Daemon]:
    extra = (
        f'[cache]\nenabled = true\nembedding_model = "tiny-embed"\nthreshold = {THRESHOLD}\nttl_secs = {TTL}\n'
        f'[[keys]]\nname = "a"\nsecret = "{KEY_A}"\n'
        f'[[keys]]\nname = "b"\nsecret = "{KEY_B}"\n'
    )
    d = Daemon(tmp_path_factory.mktemp("cache"), daemon_config(engine, models, extra))
    d.start()
    try:
        yield d
    finally:
        d.close(check_engines=True)


def client(d: Daemon, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key=key, max_retries=0, timeout=120)


def ask(d: Daemon, text: str, key: str = KEY_A, **fields: Any) -> tuple[str | None, Any]:
    """
    One non-streamed chat call: its C{x-blazar-cache} header and the
    completion.
    """
    raw = client(d, key).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=24, temperature=0, seed=1, **fields
    )
    return raw.headers.get("x-blazar-cache"), raw.parse()


def clean_stop(d: Daemon, text: str) -> list[str]:
    """
    A stop sequence that ends C{text}'s greedy answer cleanly: a character
    of it, first seen after some text.
    """
    _, probe = ask(d, text)
    answer = probe.choices[0].message.content or ""
    for i, c in enumerate(answer):
        if i > 0 and c.isascii() and c.isalnum() and c not in answer[:i] and answer[:i].strip():
            return [c]
    pytest.fail(f"no stop sequence inside the greedy answer {answer!r}")


def predicted(d: Daemon, model: str = "tiny_latest") -> float:
    """
    The tokens the model's llama-server child has generated, by its own
    count.
    """
    argv = d.engine_for(model.replace("_", ":")).cmdline()
    port = int(argv[argv.index("--port") + 1])
    key = (d.root / "data" / "run" / f"{model}.apikey").read_text().strip()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith("llamacpp:tokens_predicted_total "):
            return float(line.split()[1])
    raise AssertionError(f"no llamacpp:tokens_predicted_total in the child's metrics:\n{text[:2000]}")


def counted(d: Daemon, result: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {KEY_A}"})
        response = conn.getresponse()
        assert response.status == 200
        text = response.read().decode()
    finally:
        conn.close()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "blazar_cache_total" and s.labels == {"model": MODEL, "result": result}:
                return float(s.value)
    return 0.0


def embedding(d: Daemon, text: str) -> list[float]:
    vector = client(d).embeddings.create(model="tiny-embed", input=text).data[0].embedding
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector]


def test_the_same_prompt_twice_is_answered_from_the_cache(daemon: Daemon) -> None:
    text = "Name three rivers in Europe."
    stop = clean_stop(daemon, text)
    hits, misses = counted(daemon, "hit"), counted(daemon, "miss")
    header, first = ask(daemon, text, stop=stop)
    assert header == "miss"
    assert first.choices[0].finish_reason == "stop" and first.usage.completion_tokens > 0, first
    before = predicted(daemon)
    header, second = ask(daemon, text, stop=stop)
    assert header == "hit"
    assert predicted(daemon) == before, "the engine generated tokens for a hit"
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.model == "tiny" and second.id != first.id
    assert (counted(daemon, "hit"), counted(daemon, "miss")) == (hits + 1, misses + 1)
    # a miss does reach the engine: the counter is not stuck
    header, _ = ask(daemon, text + " Briefly.", stop=stop)
    assert header == "miss" and predicted(daemon) > before


def test_another_prompt_below_the_threshold_is_a_miss(daemon: Daemon) -> None:
    text, other = "What is the boiling point of water?", "Write a haiku about autumn leaves falling slowly."
    # the daemon embeds the last user turn's text (blazar.gateway.cache.prompt_text)
    a, b = embedding(daemon, text), embedding(daemon, other)
    cosine = sum(x * y for x, y in zip(a, b))
    assert cosine < THRESHOLD, f"the embedding model finds these alike ({cosine}): pick another pair"
    stop = clean_stop(daemon, text)
    assert ask(daemon, text, stop=stop)[0] == "miss"
    assert ask(daemon, text, stop=stop)[0] == "hit"
    before = predicted(daemon)
    assert ask(daemon, other, stop=stop)[0] == "miss"
    assert predicted(daemon) > before


def test_a_hit_never_crosses_keys(daemon: Daemon) -> None:
    text = "Which planet is the largest?"
    stop = clean_stop(daemon, text)
    assert ask(daemon, text, stop=stop)[0] == "miss"
    assert ask(daemon, text, stop=stop)[0] == "hit"
    before = predicted(daemon)
    assert ask(daemon, text, key=KEY_B, stop=stop)[0] == "miss"
    assert predicted(daemon) > before
    assert ask(daemon, text, key=KEY_B, stop=stop)[0] == "hit"


def test_streams_and_tools_bypass(daemon: Daemon) -> None:
    text = "Spell the word cache."
    stop = clean_stop(daemon, text)
    assert ask(daemon, text, stop=stop)[0] == "miss"
    assert ask(daemon, text, stop=stop)[0] == "hit"
    bypassed = counted(daemon, "bypass")
    before = predicted(daemon)
    raw = client(daemon).chat.completions.with_raw_response.create(
        model="tiny",
        messages=[{"role": "user", "content": text}],
        max_tokens=24,
        temperature=0,
        seed=1,
        stop=stop,
        stream=True,
    )
    assert raw.headers.get("x-blazar-cache") is None
    chunks = list(raw.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert predicted(daemon) > before, "a stream was answered without the engine"
    before = predicted(daemon)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look a word up",
                "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
            },
        }
    ]
    header, _ = ask(daemon, text, stop=stop, tools=tools)
    assert header is None and predicted(daemon) > before
    assert counted(daemon, "bypass") == bypassed + 2


def test_the_ollama_surface_answers_a_hit_in_its_own_shape(daemon: Daemon) -> None:
    text = "List two colours."
    stop = clean_stop(daemon, text)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "stream": False,
        "options": {"temperature": 0, "seed": 1, "num_predict": 24, "stop": stop},
    }
    headers = {"authorization": f"Bearer {KEY_A}"}
    status, first_headers, first = daemon.request("POST", "/api/chat", body, headers=headers)
    assert status == 200 and first_headers.get("x-blazar-cache") == "miss", first
    before = predicted(daemon)
    status, second_headers, second = daemon.request("POST", "/api/chat", body, headers=headers)
    assert status == 200 and second_headers.get("x-blazar-cache") == "hit", second
    assert predicted(daemon) == before
    assert json.loads(second)["message"] == json.loads(first)["message"]
    assert json.loads(second)["done"] is True


def test_anthropic_whole_answers_are_looked_up(daemon: Daemon) -> None:
    """
    A non-streamed Anthropic message is made from the engine's stream, and
    still asks the cache (the random model's answers end at max_tokens,
    truncated, so none is stored here: the unit tests store and replay
    one); a streamed one does not.
    """
    import anthropic

    sdk = anthropic.Anthropic(base_url=f"http://127.0.0.1:{daemon.port}", api_key=KEY_A, max_retries=0, timeout=120)
    # greedy, so the answer is the same every run (this SDK no longer takes temperature itself)
    ask_it: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 8,
        "extra_body": {"temperature": 0},
        "messages": [{"role": "user", "content": "Say something."}],
    }
    raw = sdk.messages.with_raw_response.create(**ask_it)
    assert raw.headers.get("x-blazar-cache") == "miss"
    assert raw.parse().stop_reason == "max_tokens"
    with sdk.messages.with_streaming_response.create(**ask_it, stream=True) as streamed:
        assert streamed.headers.get("x-blazar-cache") is None
        assert b"message_stop" in b"".join(streamed.iter_bytes())


def test_an_answer_expires_after_ttl_secs(daemon: Daemon) -> None:
    text = "How many legs does a spider have?"
    stop = clean_stop(daemon, text)
    assert ask(daemon, text, stop=stop)[0] == "miss"
    assert ask(daemon, text, stop=stop)[0] == "hit"
    time.sleep(TTL + 1)
    before = predicted(daemon)
    assert ask(daemon, text, stop=stop)[0] == "miss"
    assert predicted(daemon) > before


def test_the_entries_are_rows_in_sqlite(daemon: Daemon) -> None:
    rows = daemon.root / "data" / "blazar.db"
    assert Path(rows).exists()
    import sqlite3

    db = sqlite3.connect(f"file:{rows}?mode=ro", uri=True)
    try:
        (count,) = db.execute("SELECT count(*) FROM cache_entries").fetchone()
    finally:
        db.close()
    assert count >= 1
