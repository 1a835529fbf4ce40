"""
The C{blazar} command.

  blazar serve [--config PATH]         run the daemon in the foreground
  blazar status | version              the running daemon
  blazar ps [--json] [--reset]         loaded models (--reset closes crash breakers)
  blazar evict MODEL|KEY | --all       unload models
  blazar queue [--json]                admission: busy slots, who waits, estimated starts
  blazar cluster [--json]              the cluster's nodes: state, url, models and their queues
  blazar sessions [close NAME [--key K]]  sessions: slot, tokens cached, KV bank; end one
  blazar models list|show|cp|rm|pull   the model registry, through the daemon
  blazar keys list|add|rotate|rm       API keys (changes go to the config file)
  blazar reload                        re-read the config file
  blazar logs [MODEL] [-f]             recent log lines (one model's engine output)
  blazar run MODEL [PROMPT]            chat over the HTTP API (interactive without PROMPT)
  blazar bench MODEL [--concurrency 1,2,4] [--prompt-tokens N] [--max-tokens N] [--rounds N]
                                       tokens/s and time to first token through the gateway,
                                       recorded with the profile, engine and hardware
  blazar bench --history MODEL         past runs; the latest against the one before
  blazar doctor                        check engine, config, models dir, port, memory
  blazar engine list|install SPEC [--use]|use KIND@TAG|rollback KIND|rm KIND@TAG|prune KIND [--keep N]|check
                                       installed engines (in the data dir; no daemon needed)
  blazar models make-test PATH [--embedding|--rerank|--whisper|--image] [--seed N] [--ctx N] ...
                                       write a tiny random-weight GGUF
  blazar models quantize SOURCE TYPE [--out PATH]
                                       quantize a GGUF file (q4_K_M, q8_0, ...) with the
                                       engine's own llama-quantize (no daemon needed)

Exit codes: 0 ok, 1 error, 2 daemon not running, 3 bind conflict (serve).
Verbs other than serve, engine, make-test and quantize talk to the running daemon over its
control socket, C{<data_dir>/run/control.sock}.

The verbs live by group, each module adding its own to the parser
(L{parser} calls them in the order C{blazar --help} lists them):
L{blazar.cli.serve}, L{blazar.cli.status} (status, version, ps, queue,
sessions, evict, reload), L{blazar.cli.cluster}, L{blazar.cli.bench}, L{blazar.cli.logs},
L{blazar.cli.chat} (run), L{blazar.cli.doctor}, L{blazar.cli.engines},
L{blazar.cli.keys}, L{blazar.cli.models}; what they share (exit codes,
the control socket, the HTTP API) is L{blazar.cli.daemon}.
"""

from __future__ import annotations

import argparse
import os
import sys

from blazar.cli import bench, chat, cluster, doctor, engines, keys, logs, models, serve, status


def parser() -> argparse.ArgumentParser:
    """
    The argument parser for every verb.
    """
    p = argparse.ArgumentParser(prog="blazar", description="Local LLM gateway.")
    verbs = p.add_subparsers(dest="verb", required=True)
    for group in (serve, status, cluster, bench, logs, chat, doctor, engines, keys, models):
        group.add_verbs(verbs)
    return p


def main(argv: list[str] | None = None) -> int:
    """
    Entry point of the C{blazar} console script.
    """
    args = parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (e.g. `| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
