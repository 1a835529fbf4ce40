"""
Quantizing a GGUF model with the engine's own C{llama-quantize} (issue 39):
the tool the build lane builds beside C{llama-server}, from the same source
(L{blazar.engines.llamacpp.find_quantize} finds it), so a model is
quantized by the llama.cpp that will serve it.

Types are llama-quantize's (C{tools/quantize/quantize.cpp} of the pinned
engine, L{QUANT_TYPES}), named case-insensitively as Ollama takes them
(C{q4_K_M}, C{Q4_K_M} and C{q4_k_m} are one type). Refused before anything
runs:

  - the types that need an importance matrix (L{NEEDS_IMATRIX}: the
    lowest-bit C{IQ1}-C{IQ3} mixes and C{Q2_K_S}), which Blazar does not
    make: llama-quantize would bail out halfway;
  - an already-quantized source to another type. llama-quantize would need
    C{--allow-requantize}, and the result would carry both rounding errors
    (its own help warns of it); as Ollama does, Blazar quantizes only
    from unquantized weights (F32, F16, BF16). A source already of the
    asked type is quantized as asked (llama-quantize copies its tensors).

The child runs without blocking the reactor; its per-tensor lines
(C{[  12/ 201] blk.0.attn_q.weight - [...], type = f32, converting to q8_0
.. size = ...}), each written once that tensor is done, become
C{progress(done, total)} calls. It writes to a hidden temporary file beside
the target, which is renamed to the target only when llama-quantize
succeeded: a failure, a cancellation or a full disk leaves nothing
half-written under the target's name.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Any, Callable, Mapping

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ProcessDone, ProcessExitedAlready
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure

log = Logger()

# llama-quantize's types (QUANT_OPTIONS of the pinned engine's tools/quantize/quantize.cpp) and
# their llama_ftype (include/llama.h); Q3_K, Q4_K, Q5_K are its aliases of the _M mixes
QUANT_TYPES: Mapping[str, int] = {
    "Q1_0": 40,
    "Q2_0": 41,
    "Q4_0": 2,
    "Q4_1": 3,
    "MXFP4_MOE": 38,
    "Q5_0": 8,
    "Q5_1": 9,
    "IQ2_XXS": 19,
    "IQ2_XS": 20,
    "IQ2_S": 28,
    "IQ2_M": 29,
    "IQ1_S": 24,
    "IQ1_M": 31,
    "TQ1_0": 36,
    "TQ2_0": 37,
    "Q2_K": 10,
    "Q2_K_S": 21,
    "IQ3_XXS": 23,
    "IQ3_S": 26,
    "IQ3_M": 27,
    "Q3_K": 12,
    "IQ3_XS": 22,
    "Q3_K_S": 11,
    "Q3_K_M": 12,
    "Q3_K_L": 13,
    "IQ4_NL": 25,
    "IQ4_XS": 30,
    "Q4_K": 15,
    "Q4_K_S": 14,
    "Q4_K_M": 15,
    "Q5_K": 17,
    "Q5_K_S": 16,
    "Q5_K_M": 17,
    "Q6_K": 18,
    "Q8_0": 7,
    "F16": 1,
    "BF16": 32,
    "F32": 0,
}
# the types whose tensors llama-quantize makes only with an importance matrix (src/llama-quant.cpp
# tensor_requires_imatrix, and the mixes that use those tensor types)
NEEDS_IMATRIX = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "Q2_K_S"})
# ggml tensor types that are not quantized: F32, F16, I8, I16, I32, I64, F64, BF16
_PLAIN_TENSORS = frozenset({0, 1, 24, 25, 26, 27, 28, 30})
_PLAIN_FILE_TYPES = {0: "F32", 1: "F16", 32: "BF16"}
_ALIASES = frozenset({"Q3_K", "Q4_K", "Q5_K"})  # llama-quantize's other names of the _M mixes
_PROGRESS = re.compile(rb"^\s*\[\s*(\d+)\s*/\s*(\d+)\s*\]")
_FAILED = re.compile(rb"failed to quantize: (.*)$|error: (.*)$")
MAX_LINE = 8192  # a longer line is cut, never an error
TAIL_LINES = 12  # the output lines a failure quotes
STOP_GRACE = 5.0  # seconds from SIGTERM to SIGKILL when a quantize is cancelled


class QuantizeError(Exception):
    """
    A model cannot be quantized: the type, the source or the tool is not
    right, or llama-quantize failed. The message says why and what to do.
    """


def quant_type(name: str) -> str:
    """
    llama-quantize's name of type C{name}, which is taken case-insensitively
    (C{q4_K_M} is C{Q4_K_M}).

    @raise QuantizeError: Not a type llama-quantize takes, or one that
        needs an importance matrix (L{NEEDS_IMATRIX}).
    """
    wanted = name.strip().upper() if isinstance(name, str) else ""
    if wanted not in QUANT_TYPES:
        raise QuantizeError(
            f"unknown quantization type {name!r}: use one of {', '.join(ollama_name(t) for t in QUANT_TYPES)} "
            "(q4_K_M is a good default, q8_0 is near lossless)"
        )
    if wanted in NEEDS_IMATRIX:
        raise QuantizeError(
            f"{ollama_name(wanted)} needs an importance matrix (llama-imatrix), which Blazar does not "
            "make; use q4_K_M, q4_K_S, q3_K_M or another k-quant"
        )
    return wanted


def ollama_name(qtype: str) -> str:
    """
    A type as Ollama spells it: C{Q4_K_M} is C{q4_K_M}, C{Q8_0} is
    C{q8_0}; C{F16}, C{IQ4_XS} stay as they are.
    """
    return "q" + qtype[1:] if qtype.startswith("Q") else qtype


def quantized_name(source: Path, qtype: str) -> Path:
    """
    Where C{blazar models quantize} writes C{source} quantized to C{qtype}
    when not told: beside it, its unquantized type's suffix replaced
    (C{SmolLM2-135M-f16.gguf} to C{SmolLM2-135M-q8_0.gguf}) or the type
    added (C{tiny.gguf} to C{tiny-q8_0.gguf}).
    """
    stem = re.sub(r"(?i)[-_.](f32|f16|bf16)$", "", source.name.removesuffix(".gguf"))
    return source.with_name(f"{stem}-{ollama_name(qtype)}.gguf")


def thd_check_source(source: Path, qtype: str) -> None:
    """
    Whether C{source} can be quantized to C{qtype} (llama-quantize's name,
    L{quant_type}): a GGUF model whose weights are unquantized, or already
    of that type. Blocking (reads the file's header): call in a thread.

    @raise QuantizeError: Unreadable, not GGUF, a LoRA adapter, or already
        quantized to another type.
    """
    try:
        from gguf import GGUFReader

        reader = GGUFReader(os.fspath(source))
    except OSError as e:
        raise QuantizeError(f"{source}: cannot be read ({e.strerror or type(e).__name__})") from None
    except Exception as e:  # the gguf package raises ValueError and friends on a file that is not GGUF
        raise QuantizeError(f"{source}: not a GGUF model ({type(e).__name__}: {e})") from None

    def field(key: str) -> Any:
        return reader.fields[key].contents() if key in reader.fields else None

    if field("general.type") == "adapter":
        raise QuantizeError(
            f"{source}: is a LoRA adapter, not a model; quantize the base model and use the "
            'adapter with it (lora = [...] under its [models."name"])'
        )
    quantized = sorted({t.tensor_type.name for t in reader.tensors if int(t.tensor_type) not in _PLAIN_TENSORS})
    if not quantized:
        return
    file_type = field("general.file_type")
    if isinstance(file_type, int) and file_type == QUANT_TYPES[qtype] and qtype not in _PLAIN_FILE_TYPES.values():
        return  # already this type: llama-quantize copies what it would make
    named = [
        ollama_name(n)
        for n, v in QUANT_TYPES.items()
        if v == file_type and n not in _ALIASES and n not in _PLAIN_FILE_TYPES.values()
    ]
    was = named[0] if named else f"{'/'.join(quantized)} tensors"  # (a file type that says otherwise is wrong)
    raise QuantizeError(
        f"{source} is already quantized ({was}); quantizing it again to {ollama_name(qtype)} would stack a second "
        "rounding error on the first (llama-quantize --allow-requantize), so Blazar quantizes only from "
        "unquantized weights: start from the F16, BF16 or F32 GGUF of the model"
    )


def _temporary(target: Path) -> Path:
    return target.with_name(f".{target.name}.{secrets.token_hex(4)}.quantizing")


def thd_finish(temporary: Path, target: Path) -> None:
    """
    Make the finished C{temporary} file the C{target}: flushed to disk,
    then renamed (atomic on one filesystem). Blocking: call in a thread.
    """
    with open(temporary, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temporary, target)


def thd_discard(temporary: Path) -> None:
    """
    Remove what a failed or cancelled run left. Blocking: call in a thread.
    """
    try:
        os.unlink(temporary)
    except FileNotFoundError:
        pass


class QuantizeProtocol(ProcessProtocol):
    """
    One llama-quantize child: its output read line by line from both pipes
    (a line longer than L{MAX_LINE} is cut), its per-tensor lines turned into
    C{progress(done, total)} calls, the last L{TAIL_LINES} lines kept for a
    failure's message.
    """

    def __init__(self, progress: Callable[[int, int], None]) -> None:
        self._progress = progress
        self._partial: dict[int, bytes] = {1: b"", 2: b""}
        self.tail: list[str] = []
        self.reason: str | None = None  # what llama-quantize said when it gave up
        self.total: int | None = None
        self._ended: Failure | None = None
        self._waiting: list[Deferred[None]] = []

    def connectionMade(self) -> None:
        self.transport.closeStdin()  # type: ignore[union-attr]

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        buffered = self._partial.get(childFD, b"") + data
        *lines, rest = buffered.split(b"\n")
        self._partial[childFD] = rest[-MAX_LINE:] if len(rest) > MAX_LINE else rest
        for line in lines:
            self._line(line[:MAX_LINE])

    def _line(self, raw: bytes) -> None:
        failed = _FAILED.search(raw)
        if failed:
            self.reason = (failed.group(1) or failed.group(2)).decode("utf-8", "replace").strip()
        text = raw.rstrip(b"\r").decode("utf-8", "replace").strip()
        if text:
            self.tail = [*self.tail[-(TAIL_LINES - 1) :], text]
        found = _PROGRESS.match(raw)
        if found:  # the line is written out once its tensor is done
            done, total = int(found.group(1)), int(found.group(2))
            self.total = total
            try:
                self._progress(min(done, total), total)
            except Exception:
                log.failure("a quantize progress callback raised")

    def processEnded(self, reason: Failure) -> None:
        for raw in self._partial.values():
            if raw:
                self._line(raw)
        self._ended = reason
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            d.callback(None)

    def when_ended(self) -> Deferred[None]:
        """
        A Deferred that fires (with L{None}) once the child has ended.
        """
        d: Deferred[None] = Deferred()
        if self._ended is not None:
            d.callback(None)
        else:
            self._waiting.append(d)
        return d

    @property
    def exit_code(self) -> int | None:
        """
        The child's exit code (0 for success), L{None} while it runs or
        when a signal ended it.
        """
        if self._ended is None:
            return None
        return 0 if self._ended.check(ProcessDone) else getattr(self._ended.value, "exitCode", None)

    def stop(self, reactor: Any, grace: float = STOP_GRACE) -> None:
        """
        SIGTERM now, SIGKILL after C{grace} seconds if it still runs.
        """
        try:
            self.transport.signalProcess("TERM")  # type: ignore[union-attr]
        except ProcessExitedAlready:
            return
        timer = reactor.callLater(grace, self._kill)
        self.when_ended().addCallback(lambda _: timer.cancel() if timer.active() else None)

    def _kill(self) -> None:
        try:
            self.transport.signalProcess("KILL")  # type: ignore[union-attr]
        except ProcessExitedAlready:
            pass


async def quantize(
    reactor: Any,
    binary: Path,
    source: Path,
    target: Path,
    qtype: str,
    progress: Callable[[int, int], None],
    *,
    threads: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """
    Quantize GGUF C{source} to C{target} as C{qtype} with llama-quantize
    C{binary} (L{blazar.engines.llamacpp.find_quantize}).

    @param reactor: Spawns the child (C{IReactorProcess}), runs the file
        work in its thread pool (C{IReactorThreads}) and times the kill of
        a cancelled child (C{IReactorTime}).
    @param qtype: A type llama-quantize takes, any case (C{q4_K_M},
        C{q4_K_S}, C{q8_0}, ...: L{QUANT_TYPES}).
    @param progress: Called with C{(done, total)} tensors as each is
        written (C{total} is the model's tensor count; the last call is
        C{(total, total)}, before the file is renamed into place).
    @param threads: llama-quantize's threads (default: all the CPUs).
    @param environ: The child's environment (default: this process's);
        C{LLAMA_ARG_*} variables are left out.
    @raise QuantizeError: The type or the source is refused (nothing is
        started), or llama-quantize failed (its own words quoted); nothing
        is left under C{target}'s name, nor beside it.
    @raise CancelledError: Cancelled: the child is stopped (SIGTERM, then
        SIGKILL) and its partial output removed before this raises.
    """
    name = quant_type(qtype)
    source, target = Path(source), Path(target)
    pool = reactor.getThreadPool()
    if source.absolute() == target.absolute():
        raise QuantizeError(f"{target}: the quantized model must go to another file than its source")
    await deferToThreadPool(reactor, pool, thd_check_source, source, name)
    temporary = _temporary(target)
    argv = [str(binary), str(source), str(temporary), name, *([str(threads)] if threads else [])]
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if not k.startswith("LLAMA_ARG_")}
    child = QuantizeProtocol(progress)
    try:
        try:
            reactor.spawnProcess(child, str(binary), argv, env=env, childFDs={0: "w", 1: "r", 2: "r"})
        except OSError as e:
            raise QuantizeError(f"cannot run {binary}: {e.strerror or e}") from None
        log.info("quantizing {source} to {qtype}: {argv}", source=str(source), qtype=name, argv=" ".join(argv))
        try:
            await child.when_ended()
        except CancelledError:
            child.stop(reactor)
            await child.when_ended()
            raise
        if child.exit_code != 0:
            why = child.reason or " / ".join(child.tail[-3:]) or "no output"
            raise QuantizeError(
                f"llama-quantize could not quantize {source.name} to {ollama_name(name)} "
                f"(exit {child.exit_code}): {why}"
            )
        try:
            await deferToThreadPool(reactor, pool, thd_finish, temporary, target)
        except OSError as e:
            raise QuantizeError(f"cannot write {target}: {e.strerror or e}") from None
    finally:
        await deferToThreadPool(reactor, pool, thd_discard, temporary)  # (gone already after a success)
