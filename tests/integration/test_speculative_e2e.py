"""
Speculative decoding on the real llama-server with a real model
(SmolLM2-135M-Instruct, from its wheel): C{speculative = "ngram"} starts
the child with n-gram lookup and the model's lookup cache under
C{<data_dir>/speccache/}; a "repeat this code with one change" request
(temperature 0) drafts from the code it was shown, and C{/api/ps} shows
the acceptance the hints job read from the child's C{/metrics}; the cache
file outlives the child and a daemon restart, and is the one the next
child is given. C{speculative = "draft"} with a draft model named by its
model name drafts; a draft model of another vocabulary stops twistd at
startup with the fix.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from blazar.engines.lookupcache import NgramCounts
from blazar.models.testmodel import make_test_model
from tests.integration.harness import Daemon, real_model

MODEL = "smollm:latest"
CODE = """def parse_config(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def merge_settings(base, override):
    result = dict(base)
    for key, value in override.items():
        result[key] = value
    return result


def validate_settings(settings):
    errors = []
    for key, value in settings.items():
        if not value:
            errors.append(key)
    return errors


def main(argv):
    base = parse_config(argv[1])
    override = parse_config(argv[2])
    settings = merge_settings(base, override)
    errors = validate_settings(settings)
    if errors:
        print("missing:", ", ".join(errors))
        return 1
    for key in sorted(settings):
        print(key, settings[key])
    return 0
"""
REPEAT = [
    {
        "role": "user",
        "content": "Repeat this code with one change: rename merge_settings to combine_settings.\n\n```python\n"
        + CODE
        + "```",
    },
    {"role": "assistant", "content": "```python\n"},
]
# the hints job reads each child's /metrics every 60 s
SCRAPE = 60.0


def ask(daemon: Daemon) -> str:
    status, body = daemon.post_json(
        "/v1/chat/completions",
        {"model": "smollm", "messages": REPEAT, "temperature": 0, "max_tokens": 400},
        timeout=600,
    )
    assert status == 200, body
    return str(body["choices"][0]["message"]["content"])


def copied(answer: str) -> float:
    """
    The share of the code's non-blank lines that the change leaves alone
    (those without C{merge_settings}) that the answer repeats as they were.

    SmolLM2-135M repeats the code but does not reliably make the rename
    (at temperature 0 it keeps C{merge_settings}): the test holds it to
    what it does, repeating what it was shown, which is the work n-gram
    lookup drafts from.
    """
    want = [line for line in CODE.splitlines() if line.strip() and "merge_settings" not in line]
    got = {line.rstrip() for line in answer.splitlines()}
    return sum(line in got for line in want) / len(want)


def speculative(daemon: Daemon, wait: float) -> dict[str, Any]:
    """
    C{smollm}'s C{speculative} object in C{/api/ps}, once it shows an
    acceptance (waiting up to C{wait} seconds for the hints job).
    """
    deadline = time.monotonic() + wait
    while True:
        status, _, raw = daemon.request("GET", "/api/ps")
        assert status == 200, raw
        (row,) = [m for m in json.loads(raw)["models"] if m["name"] == MODEL]
        if row["speculative"]["acceptance"] is not None or time.monotonic() > deadline:
            return dict(row["speculative"])
        time.sleep(1.0)


def serving(root: Path, engine: str) -> Daemon:
    return Daemon(
        root,
        f'models_dir = "{root / "models"}"\n[engines.llamacpp]\nbinary = "{engine}"\n'
        '[models."smollm"]\nparallel = 1\nctx_size = 2048\nspeculative = "ngram"\n',
    )


def test_ngram_lookup_drafts(engine: str, tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smollm.gguf").symlink_to(real_model())
    cache = tmp_path / "data" / "speccache" / "smollm_latest" / "lookup-dynamic.bin"
    daemon = serving(tmp_path, engine).start()
    try:
        answer = ask(daemon)
        argv = daemon.engine_for(MODEL).cmdline()
        assert argv[argv.index("--spec-type") + 1] == "ngram-mod,ngram-cache"
        assert argv[argv.index("--spec-ngram-mod-n-max") + 1] == "16"
        assert argv[argv.index("-lcd") + 1] == str(cache)
        # the model repeats the code: the lines the change leaves alone, as they were
        assert copied(answer) >= 0.8, answer
        shown = speculative(daemon, SCRAPE + 30)
        assert shown["mode"] == "ngram"
        assert shown["acceptance"] is not None and shown["acceptance"] > 0, shown
        assert shown["accepted_per_draft"] is not None and shown["accepted_per_draft"] > 0, shown
    finally:
        daemon.close(check_engines=True)


STORY = [{"role": "user", "content": "Write a short story about a fox who learns to sail."}]


def story(daemon: Daemon) -> tuple[str, int, int]:
    """
    The model's story (temperature 0: the same each time), with the tokens
    its child drafted and accepted for it (llama-server's C{timings}, which
    Blazar passes on).
    """
    status, body = daemon.post_json(
        "/v1/chat/completions",
        {"model": "smollm", "messages": STORY, "temperature": 0, "max_tokens": 200},
        timeout=600,
    )
    assert status == 200, body
    timings = body["timings"]
    return str(body["choices"][0]["message"]["content"]), int(timings["draft_n"]), int(timings["draft_n_accepted"])


def test_the_lookup_cache_outlives_a_restart(engine: str, tmp_path: Path) -> None:
    """
    The lookup cache Blazar keeps from the model's answers: a story told
    twice is counted into C{<data_dir>/speccache/}, written at stop in the
    engine's format; after a daemon restart the new child loads it and
    drafts the story from it (the prompt has none of it), where a child
    given an empty cache drafts next to nothing: acceptance is not back
    to zero.
    """
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smollm.gguf").symlink_to(real_model())
    cache = tmp_path / "data" / "speccache" / "smollm_latest" / "lookup-dynamic.bin"
    daemon = serving(tmp_path, engine).start()
    try:
        told, _, _ = story(daemon)
        assert story(daemon)[0] == told
    finally:
        daemon.close(check_engines=True)
    counts = NgramCounts.from_bytes(cache.read_bytes())  # the engine's format, whole
    assert len(counts) > 100, len(counts)
    saved = cache.read_bytes()

    daemon = serving(tmp_path, engine).start()
    try:
        text, drafted, accepted = story(daemon)
        argv = daemon.engine_for(MODEL).cmdline()
        assert argv[argv.index("-lcd") + 1] == str(cache)
    finally:
        daemon.close(check_engines=True)
    assert text == told
    # the same story again: now from the cache the child loaded
    assert accepted >= 50 and accepted / drafted >= 0.5, (drafted, accepted)

    # the same restart with the cache emptied: the child has nothing to draft the story from
    cache.write_bytes(b"")
    daemon = serving(tmp_path, engine).start()
    try:
        text, fresh_drafted, fresh_accepted = story(daemon)
    finally:
        daemon.close(check_engines=True)
    print(
        f"\nstory after a restart: drafted {drafted} accepted {accepted}; with an empty cache: drafted {fresh_drafted} accepted {fresh_accepted}"
    )
    assert accepted >= 2 * fresh_accepted + 20, (accepted, fresh_accepted, fresh_drafted)
    assert len(saved) > 0


def test_a_draft_model_by_name_drafts(engine: str, tmp_path: Path) -> None:
    """
    C{speculative = "draft"} with C{draft_model} naming another model of
    C{models_dir}: the child gets that model's file as its draft model
    (here SmolLM2 drafting for itself, the same vocabulary), answers, and
    C{/api/ps} shows what it accepted.
    """
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smollm.gguf").symlink_to(real_model())
    (tmp_path / "models" / "smoldraft.gguf").symlink_to(real_model())
    daemon = Daemon(
        tmp_path,
        f'models_dir = "{tmp_path / "models"}"\n[engines.llamacpp]\nbinary = "{engine}"\n'
        '[models."smollm"]\nparallel = 1\nctx_size = 2048\nspeculative = "draft"\ndraft_model = "smoldraft"\n'
        "draft_max = 4\n",
    ).start()
    try:
        status, body = daemon.post_json(
            "/v1/chat/completions",
            {"model": "smollm", "messages": REPEAT, "temperature": 0, "max_tokens": 64},
            timeout=600,
        )
        assert status == 200 and body["choices"][0]["message"]["content"], body
        argv = daemon.engine_for(MODEL).cmdline()
        assert argv[argv.index("--spec-type") + 1] == "draft-simple"
        assert argv[argv.index("--spec-draft-model") + 1] == str(tmp_path / "models" / "smoldraft.gguf")
        assert argv[argv.index("--spec-draft-n-max") + 1] == "4"
        shown = speculative(daemon, SCRAPE + 30)
        assert shown["mode"] == "draft"
        assert shown["acceptance"] is not None and shown["acceptance"] > 0.5, shown
        # at most draft_max tokens a draft
        assert shown["accepted_per_draft"] is not None and 0 < shown["accepted_per_draft"] <= 4, shown
    finally:
        daemon.close(check_engines=True)


def test_a_draft_model_of_another_vocabulary_stops_startup(engine: str, tmp_path: Path) -> None:
    make_test_model(tmp_path / "models" / "big.gguf")
    make_test_model(tmp_path / "models" / "other.gguf", extra_words=("zebra",))
    daemon = Daemon(
        tmp_path,
        f'models_dir = "{tmp_path / "models"}"\n[engines.llamacpp]\nbinary = "{engine}"\n'
        '[models."big"]\nspeculative = "draft"\ndraft_model = "other"\n',
    )
    daemon.start(wait=False)
    assert daemon.proc is not None
    try:
        code = daemon.proc.wait(timeout=60)
    finally:
        daemon.kill_everything()
    assert code != 0
    log = daemon.log()
    assert "does not share the model's vocabulary" in log, log
    assert 'set speculative = "ngram"' in log, log
