"""
C{blazar run}: chat with a model over the daemon's HTTP API (its Ollama
C{/api/chat}), one prompt or interactively.
"""

from __future__ import annotations

import argparse
import json
import sys

from blazar.cli.daemon import ERROR, OK, Verbs, api_key, daemon_http, post_ndjson


def _run(args: argparse.Namespace) -> int:
    """
    One-shot (PROMPT given) or interactive chat over the daemon's HTTP API,
    printing the answer as it streams.
    """

    where = daemon_http(args, "run")
    if isinstance(where, int):
        return where
    host, port, base = where
    history: list[dict[str, str]] = []

    def ask(prompt: str) -> int:
        history.append({"role": "user", "content": prompt})
        resp = post_ndjson(
            host, port, base, "/api/chat", {"model": args.model, "messages": history}, timeout=600, key=api_key(args)
        )
        if isinstance(resp, int):
            return resp
        answer = []
        for raw in resp:
            line = json.loads(raw)
            if "error" in line:
                print(f"\nblazar: {line['error']}", file=sys.stderr)
                return ERROR
            text = (line.get("message") or {}).get("content", "")
            answer.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
        print()
        history.append({"role": "assistant", "content": "".join(answer)})
        return OK

    if args.prompt:
        return ask(" ".join(args.prompt))
    print(f"chatting with {args.model}; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            return OK
        if not line.strip():
            return OK
        code = ask(line)
        if code:
            return code


def add_verbs(verbs: Verbs) -> None:
    """
    Add C{run} to the parser.
    """
    run = verbs.add_parser("run", help="chat with a model (one prompt, or interactively)")
    run.add_argument("model")
    run.add_argument("prompt", nargs="*", help="the prompt; none for an interactive chat")
    run.add_argument("--config", "-c")
    run.add_argument("--key", help="an API key, for a gateway with keys (default: $BLAZAR_API_KEY)")
    run.set_defaults(func=_run)
