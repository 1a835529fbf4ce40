"""
C{blazar models}: the model registry through the daemon (list, show, cp,
rm; pull over its HTTP API), and two verbs that need no daemon: quantize
(the engine's own llama-quantize) and make-test (a tiny random-weight
model).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blazar import strictjson
from blazar.cli.daemon import (
    ERROR,
    OK,
    USAGE,
    Verbs,
    api_key,
    control,
    daemon_http,
    one_call,
    post_ndjson,
    run_reactor,
)

if TYPE_CHECKING:
    from twisted.protocols.amp import AMP


def _models_list(args: argparse.Namespace) -> int:
    from blazar.protocols.control import Models

    async def action(p: AMP) -> int:
        models = (await p.callRemote(Models))["models"]
        if args.json:
            print(strictjson.encode(models))
        else:
            for m in models:
                print(f"{m['name']:<40} {m['path']}")
        return OK

    return control(args, action)


def _models_show(args: argparse.Namespace) -> int:
    from blazar.protocols.control import ModelShow

    async def action(p: AMP) -> int:
        m = await p.callRemote(ModelShow, name=args.name)
        if args.json:
            print(strictjson.encode(m))
        else:
            for key in (
                "name",
                "path",
                "size",
                "architecture",
                "parameters",
                "quantization",
                "context_length",
                "chat_template",
                "loaded",
            ):
                print(f"{key:<15} {m[key]}")
        return OK

    return control(args, action)


def _models_cp(args: argparse.Namespace) -> int:
    from blazar.protocols.control import ModelCopy

    return one_call(
        args,
        ModelCopy,
        lambda done: f"copied {args.source} to {done['name']}",
        source=args.source,
        destination=args.destination,
    )


def _models_rm(args: argparse.Namespace) -> int:
    from blazar.protocols.control import ModelRemove

    return one_call(args, ModelRemove, lambda done: f"deleted {done['name']}", name=args.name)


def _models_pull(args: argparse.Namespace) -> int:
    """
    Pull over the daemon's Ollama API (/api/pull), with a progress line.
    """

    where = daemon_http(args, "models pull")
    if isinstance(where, int):
        return where
    host, port, base = where
    resp = post_ndjson(host, port, base, "/api/pull", {"model": args.name}, timeout=3600, key=api_key(args))
    if isinstance(resp, int):
        return resp
    for raw in resp:
        line = json.loads(raw)
        if "error" in line:
            print(f"\nblazar: {line['error']}", file=sys.stderr)
            return ERROR
        if line.get("total"):
            done, total = line.get("completed", 0), line["total"]
            bar = "#" * int(30 * done / total)
            if sys.stderr.isatty():
                sys.stderr.write(f"\r{line['status']} [{bar:<30}] {done / 2**20:.1f}/{total / 2**20:.1f} MiB")
            elif done == total:  # a log or a pipe: each part once, when it is complete
                sys.stderr.write(f"\n{line['status']} {total / 2**20:.1f} MiB")
        else:
            sys.stderr.write(f"\n{line.get('status', '')}")
        sys.stderr.flush()
    sys.stderr.write("\n")
    return OK


def _models_quantize(args: argparse.Namespace) -> int:
    """
    Quantize a GGUF file with the engine's own llama-quantize
    (L{blazar.models.quantize}), here, without the daemon: a progress line,
    then the new file's path on stdout.
    """
    from blazar.config import ConfigError, resolve_config
    from blazar.engines.llamacpp import find_quantize
    from blazar.models.quantize import QuantizeError, ollama_name, quant_type, quantize, quantized_name

    try:
        config = resolve_config(args.config)
        qtype = quant_type(args.type)
        source = Path(args.source).expanduser()
        if not source.is_file():
            raise QuantizeError(f"{source}: no such file (give the path of a GGUF model)")
        target = Path(args.out).expanduser() if args.out else quantized_name(source, qtype)
        if target.exists():
            raise QuantizeError(f"{target} exists already: remove it first, or name another file with --out")
        binary = find_quantize(config, os.environ)
    except (ConfigError, QuantizeError) as e:
        print(f"blazar: {e}", file=sys.stderr)
        return ERROR
    shown = {"tenth": -1}

    def progress(done: int, total: int) -> None:
        bar = "#" * (30 * done // max(total, 1))
        if sys.stderr.isatty():
            sys.stderr.write(f"\rquantizing {source.name} to {ollama_name(qtype)} [{bar:<30}] {done}/{total} tensors")
        elif (tenth := 10 * done // max(total, 1)) != shown["tenth"]:  # a log or a pipe: a line per 10 %
            shown["tenth"] = tenth
            sys.stderr.write(f"quantizing {source.name} to {ollama_name(qtype)}: {done}/{total} tensors\n")
        sys.stderr.flush()

    async def main(reactor: Any) -> int:
        try:
            await quantize(reactor, binary, source, target, qtype, progress)
        except QuantizeError as e:
            print(f"\nblazar: {e}", file=sys.stderr)
            return ERROR
        sys.stderr.write("\n")
        print(target)
        return OK

    return run_reactor(main)


def _make_test(args: argparse.Namespace) -> int:
    """
    Write a tiny random-weight model (L{blazar.models.testmodel}; whisper:
    L{blazar.models.testwhisper}; image: L{blazar.models.testimage}) and
    print its path; L{USAGE} for a shape the generator cannot make.
    """
    if args.whisper:
        from blazar.models.testwhisper import make_test_whisper_model

        print(make_test_whisper_model(Path(args.path), seed=args.seed))
        return OK
    if args.image:
        from blazar.models.testimage import make_test_image_model

        path = Path(args.path).absolute()
        tae = path.with_name(path.stem + ".taesd.gguf.tae")  # not a .gguf: models_dir would list it as a model
        made, tae = make_test_image_model(path, tae, seed=args.seed)
        print(made)
        print(
            f'# sd-server needs its tiny autoencoder: put this in the config\n[models."{path.stem}"]\n'
            f'args = ["--taesd", "{tae}"]',
            file=sys.stderr,
        )
        return OK
    from blazar.models import testmodel

    if args.heads < 1 or args.embd % args.heads or (args.embd // args.heads) % 2:
        print(
            f"blazar: --embd {args.embd} must be a multiple of 2 x --heads {args.heads} (an even head size)",
            file=sys.stderr,
        )
        return USAGE
    if min(args.ctx, args.layers, args.ff) < 1:
        print("blazar: --ctx, --layers and --ff must be positive", file=sys.stderr)
        return USAGE
    template = {
        "plain": testmodel.CHAT_TEMPLATE,
        "strict": testmodel.STRICT_CHAT_TEMPLATE,
        "thinking": testmodel.THINKING_CHAT_TEMPLATE,
    }[args.template]
    model = testmodel.make_test_model(
        args.path,
        seed=args.seed,
        embedding=args.embedding,
        rerank=args.rerank,
        context_length=args.ctx,
        n_embd=args.embd,
        n_layer=args.layers,
        n_head=args.heads,
        n_ff=args.ff,
        chat_template=template,
    )
    print(model.path)
    if args.ctx > 4096:
        name = Path(args.path).stem
        print(
            f"# its trained context is {args.ctx} tokens; Blazar starts it with 4096 per slot unless told:\n"
            f'[models."{name}"]\nctx_size = {args.ctx}',
            file=sys.stderr,
        )
    return OK


def add_verbs(verbs: Verbs) -> None:
    """
    Add C{models} and its verbs to the parser.
    """
    models = verbs.add_parser("models", help="model files")
    model_verbs = models.add_subparsers(dest="models_verb", required=True)
    listing = model_verbs.add_parser("list", help="the models the daemon serves")
    listing.add_argument("--config", "-c")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=_models_list)
    for name, help_, func, params in [
        ("show", "one model's file and GGUF facts", _models_show, ["name"]),
        ("cp", "another name for a model (a hard link, no copy)", _models_cp, ["source", "destination"]),
        ("rm", "delete a model's file (its engine is stopped first)", _models_rm, ["name"]),
        (
            "pull",
            "download name[:tag], ns/name[:tag] (the registry) or hf.co/{user}/{repo}[:{quant}] through the daemon",
            _models_pull,
            ["name"],
        ),
    ]:
        verb = model_verbs.add_parser(name, help=help_)
        for param in params:
            verb.add_argument(param)
        verb.add_argument("--config", "-c")
        verb.add_argument("--json", action="store_true")
        if name == "pull":  # over the HTTP API, as a client
            verb.add_argument("--key", help="an unscoped API key, for a gateway with keys (default: $BLAZAR_API_KEY)")
        verb.set_defaults(func=func)
    quantize = model_verbs.add_parser(
        "quantize", help="quantize a GGUF file with the engine's own llama-quantize (no daemon needed)"
    )
    quantize.add_argument("source", help="the GGUF model file (F32, F16 or BF16 weights)")
    quantize.add_argument("type", help="q4_K_M, q4_K_S, q8_0, q5_K_M, q6_K, ... (any case)")
    quantize.add_argument("--out", metavar="PATH", help="where to write it (default: beside it, named for the type)")
    quantize.add_argument("--config", "-c")
    quantize.set_defaults(func=_models_quantize)
    make = model_verbs.add_parser(
        "make-test", help="write a tiny random-weight model for tests and demos (llama GGUF; whisper or image)"
    )
    make.add_argument("path", help="where to write it (.gguf; a whisper model: ggml-NAME.bin)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--embedding", action="store_true", help="mark it for mean-pooled embeddings")
    make.add_argument("--rerank", action="store_true", help="a reranker (rank pooling: POST /v1/rerank)")
    make.add_argument(
        "--ctx",
        type=int,
        default=2048,
        metavar="N",
        help="its trained context in tokens (a coding agent wants 131072; default 2048)",
    )
    make.add_argument("--embd", type=int, default=64, metavar="N", help="embedding width (default 64)")
    make.add_argument("--layers", type=int, default=2, metavar="N", help="transformer blocks (default 2)")
    make.add_argument("--heads", type=int, default=4, metavar="N", help="attention heads (default 4)")
    make.add_argument("--ff", type=int, default=128, metavar="N", help="feed-forward width (default 128)")
    make.add_argument(
        "--template",
        choices=("plain", "strict", "thinking"),
        default="plain",
        help="its chat template: plain ChatML with tools (default); strict (a system message "
        "only first); thinking (a reasoning block first)",
    )
    make.add_argument(
        "--whisper", action="store_true", help="a whisper.cpp model (speech to text: POST /v1/audio/transcriptions)"
    )
    make.add_argument(
        "--image",
        action="store_true",
        help="a Flux.2-klein GGUF and its tiny autoencoder (POST /v1/images/generations)",
    )
    make.set_defaults(func=_make_test)
