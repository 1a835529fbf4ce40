"""
The C{blazar} command.

  blazar serve [--config PATH]         run the daemon in the foreground
  blazar models make-test PATH [--embedding] [--seed N]
                                       write a tiny random-weight GGUF
"""

from __future__ import annotations

import argparse
import sys


def _serve(args: argparse.Namespace) -> int:
    from twisted.scripts.twistd import run

    argv = ["twistd", "--nodaemon", "--pidfile=", "blazar"]
    if args.config:
        argv += ["--config", args.config]
    sys.argv = argv
    run()
    return 0


def _make_test(args: argparse.Namespace) -> int:
    from blazar.testing import make_test_model

    model = make_test_model(args.path, seed=args.seed, embedding=args.embedding)
    print(model.path)
    return 0


def parser() -> argparse.ArgumentParser:
    """
    The argument parser for every verb.
    """
    p = argparse.ArgumentParser(prog="blazar", description="Local LLM gateway.")
    verbs = p.add_subparsers(dest="verb", required=True)
    serve = verbs.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--config", "-c", help="config.toml (default: $BLAZAR_CONFIG or ~/.config/blazar/config.toml)")
    serve.set_defaults(func=_serve)
    models = verbs.add_parser("models", help="model files")
    model_verbs = models.add_subparsers(dest="models_verb", required=True)
    make = model_verbs.add_parser(
        "make-test", help="write a tiny random-weight llama GGUF for tests and demos"
    )
    make.add_argument("path", help="where to write the .gguf file")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--embedding", action="store_true", help="mark it for mean-pooled embeddings")
    make.set_defaults(func=_make_test)
    return p


def main(argv: list[str] | None = None) -> int:
    """
    Entry point of the C{blazar} console script.
    """
    args = parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
