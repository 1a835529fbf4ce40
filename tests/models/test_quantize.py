"""
L{blazar.models.quantize}: the types, the sources refused, llama-quantize's
output read into progress, and the child driven through a fake reactor
(the real llama-quantize: tests/integration/test_quantize_e2e.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from twisted.internet.defer import CancelledError, Deferred
from twisted.trial.unittest import SynchronousTestCase

from blazar.models.quantize import (
    QuantizeError,
    QuantizeProtocol,
    ollama_name,
    quant_type,
    quantize,
    quantized_name,
    thd_check_source,
)
from blazar.models.testmodel import make_test_lora, make_test_model
from blazar.testing import fake_process_reactor


def quantized_model(path: Path, file_type: int = 7) -> Path:
    """
    A GGUF holding one Q8_0 tensor, its C{general.file_type} C{file_type}.
    """
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    writer = GGUFWriter(os.fspath(path), "llama")
    writer.add_file_type(file_type)
    data = quants.quantize(np.ones((4, 64), dtype=np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", data, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class TypeTests(SynchronousTestCase):
    def test_names_in_any_case_as_ollama_takes_them(self) -> None:
        for given, name in [
            ("q4_K_M", "Q4_K_M"),
            ("Q4_k_s", "Q4_K_S"),
            ("q8_0", "Q8_0"),
            (" F16 ", "F16"),
            ("iq4_xs", "IQ4_XS"),
            ("q4_k", "Q4_K"),
        ]:
            self.assertEqual(quant_type(given), name)
        self.assertEqual(
            [ollama_name(t) for t in ("Q4_K_M", "Q8_0", "F16", "IQ4_XS")], ["q4_K_M", "q8_0", "F16", "IQ4_XS"]
        )

    def test_unknown_and_imatrix_types_are_refused(self) -> None:
        with self.assertRaises(QuantizeError) as cm:
            quant_type("q4_K_X")
        self.assertIn("unknown quantization type 'q4_K_X': use one of", str(cm.exception))
        self.assertIn("q4_K_M", str(cm.exception))
        self.assertNotIn("COPY", str(cm.exception))
        with self.assertRaises(QuantizeError):
            quant_type("copy")  # llama-quantize's tensor copy: not a quantization
        with self.assertRaises(QuantizeError) as cm:
            quant_type("iq2_xxs")
        self.assertIn("needs an importance matrix", str(cm.exception))

    def test_the_default_target_is_named_for_the_type(self) -> None:
        self.assertEqual(quantized_name(Path("/m/SmolLM2-135M-f16.gguf"), "Q8_0"), Path("/m/SmolLM2-135M-q8_0.gguf"))
        self.assertEqual(quantized_name(Path("/m/tiny.gguf"), "Q4_K_M"), Path("/m/tiny-q4_K_M.gguf"))
        self.assertEqual(quantized_name(Path("/m/x.BF16.gguf"), "Q6_K"), Path("/m/x-q6_K.gguf"))


class SourceTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.dir.mkdir()

    def test_unquantized_weights_quantize_to_any_type(self) -> None:
        model = make_test_model(self.dir / "m.gguf").path
        for qtype in ("Q8_0", "Q4_K_M", "F16"):
            thd_check_source(model, qtype)

    def test_a_quantized_source_only_to_its_own_type(self) -> None:
        q8 = quantized_model(self.dir / "q8.gguf")
        thd_check_source(q8, "Q8_0")  # llama-quantize copies it
        with self.assertRaises(QuantizeError) as cm:
            thd_check_source(q8, "Q4_K_M")
        message = str(cm.exception)
        self.assertIn("is already quantized (q8_0)", message)
        self.assertIn("--allow-requantize", message)
        self.assertIn("start from the F16, BF16 or F32 GGUF", message)
        with self.assertRaises(QuantizeError):
            thd_check_source(q8, "F16")  # dequantizing is requantizing too
        mislabelled = quantized_model(self.dir / "odd.gguf", file_type=0)
        with self.assertRaises(QuantizeError) as cm:
            thd_check_source(mislabelled, "Q8_0")
        self.assertIn("is already quantized (Q8_0 tensors)", str(cm.exception))  # its file type says F32

    def test_not_a_model(self) -> None:
        with self.assertRaises(QuantizeError) as cm:
            thd_check_source(make_test_lora(self.dir / "a.gguf"), "Q8_0")
        self.assertIn("is a LoRA adapter, not a model", str(cm.exception))
        (self.dir / "x.gguf").write_bytes(b"not gguf" * 8)
        with self.assertRaises(QuantizeError) as cm:
            thd_check_source(self.dir / "x.gguf", "Q8_0")
        self.assertIn("not a GGUF model", str(cm.exception))
        with self.assertRaises(QuantizeError) as cm:
            thd_check_source(self.dir / "gone.gguf", "Q8_0")
        self.assertIn("cannot be read (No such file or directory)", str(cm.exception))


# what the pinned llama-quantize writes (stderr), cut where a pipe may cut it
OUTPUT = (
    b"main: quantizing 'm.gguf' to 'x' as Q8_0\n"
    b"[   1/   3]                    token_embd.weight - [   64,   290,     1,     1], type =    f32, conv"
    b"erting to q8_0 .. size =     0.07 MiB ->     0.02 MiB\n[   2/   3]               output_norm.weight - "
    b"[   64,     1,     1,     1], type =    f32, size =    0.000 MiB\n"
    b"[   3/   3]                        output.weight - [   64,   290,     1,     1], type =    f32, converting "
    b"to q8_0 .. size =     0.07 MiB ->     0.02 MiB\nllama_model_quantize_impl: model size  =     0.14 MiB\n"
)


class ProtocolTests(SynchronousTestCase):
    def test_each_finished_tensor_is_progress(self) -> None:
        seen: list[tuple[int, int]] = []
        child = QuantizeProtocol(lambda done, total: seen.append((done, total)))
        for i in range(0, len(OUTPUT), 37):
            child.childDataReceived(2, OUTPUT[i : i + 37])
        self.assertEqual(seen, [(1, 3), (2, 3), (3, 3)])
        self.assertEqual(child.total, 3)
        self.assertIsNone(child.reason)
        self.assertEqual(child.tail[-1], "llama_model_quantize_impl: model size  =     0.14 MiB")

    def test_a_failure_is_quoted_and_a_long_line_is_cut(self) -> None:
        child = QuantizeProtocol(lambda done, total: None)
        child.childDataReceived(1, b"x" * 100_000 + b"\n")
        child.childDataReceived(
            2,
            b"[   1/   9] blk.0.attn_q.weight - [64, 64, 1, 1], type = q8_0, "
            b"llama_model_quantize: failed to quantize: requantizing from type q8_0 is "
            b"disabled\n",
        )
        self.assertEqual(child.reason, "requantizing from type q8_0 is disabled")
        self.assertLessEqual(len(child.tail[0]), 8192)

    def test_a_raising_progress_callback_is_logged_not_fatal(self) -> None:
        def progress(done: int, total: int) -> None:
            raise RuntimeError("boom")

        child = QuantizeProtocol(progress)
        child.childDataReceived(2, b"[   1/   2] a\n[   2/   2] b\n")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)
        self.assertEqual(child.total, 2)


class QuantizeTests(SynchronousTestCase):
    """
    L{quantize} against a fake reactor: the child's argv and environment,
    the temporary file renamed only on success, removed on failure and on
    cancellation.
    """

    def setUp(self) -> None:
        self.dir = Path(self.mktemp()).absolute()
        self.source = make_test_model(self.dir / "m.gguf").path
        self.target = self.dir / "out" / "m-q8_0.gguf"
        self.target.parent.mkdir()
        self.reactor = fake_process_reactor()
        self.seen: list[tuple[int, int]] = []

    def start(self, qtype: str = "q8_0") -> Deferred[None]:
        return Deferred.fromCoroutine(
            quantize(
                self.reactor,
                Path("/e/bin/llama-quantize"),
                self.source,
                self.target,
                qtype,
                lambda done, total: self.seen.append((done, total)),
                environ={"PATH": "/bin", "LLAMA_ARG_CTX_SIZE": "9"},
            )
        )

    def leftovers(self) -> list[str]:
        return sorted(p.name for p in self.target.parent.iterdir())

    def test_written_then_renamed(self) -> None:
        d = self.start()
        ((transport, executable, argv, env),) = self.reactor.spawned
        self.assertEqual(executable, "/e/bin/llama-quantize")
        temporary = Path(argv[2])
        self.assertEqual(argv, ["/e/bin/llama-quantize", str(self.source), str(temporary), "Q8_0"])
        self.assertEqual(temporary.parent, self.target.parent)
        self.assertTrue(temporary.name.startswith(".m-q8_0.gguf.") and temporary.name.endswith(".quantizing"))
        self.assertEqual(env, {"PATH": "/bin"})  # no LLAMA_ARG_* for the child
        self.assertTrue(transport.stdin_closed)
        temporary.write_bytes(b"GGUF quantized")
        transport.protocol.childDataReceived(2, OUTPUT)
        self.assertNoResult(d)
        self.assertFalse(self.target.exists())  # not before it exits
        transport.exit(0)
        self.successResultOf(d)
        self.assertEqual(self.target.read_bytes(), b"GGUF quantized")
        self.assertEqual(self.leftovers(), ["m-q8_0.gguf"])
        self.assertEqual(self.seen, [(1, 3), (2, 3), (3, 3)])

    def test_a_failure_leaves_nothing(self) -> None:
        d = self.start()
        ((transport, _, argv, _),) = self.reactor.spawned
        Path(argv[2]).write_bytes(b"half")
        transport.protocol.childDataReceived(2, b"llama_model_quantize: failed to quantize: disk full\n")
        transport.exit(1)
        error = self.failureResultOf(d, QuantizeError).value
        self.assertEqual(str(error), "llama-quantize could not quantize m.gguf to q8_0 (exit 1): disk full")
        self.assertEqual(self.leftovers(), [])

    def test_a_cancel_stops_the_child_and_leaves_nothing(self) -> None:
        d = self.start()
        ((transport, _, argv, _),) = self.reactor.spawned
        Path(argv[2]).write_bytes(b"half")
        d.cancel()
        self.assertEqual(transport.signals, ["TERM"])
        self.assertNoResult(d)  # until the child is gone
        self.reactor.advance(5)
        self.assertEqual(transport.signals, ["TERM", "KILL"])
        transport.exit(None, 9)
        self.failureResultOf(d, CancelledError)
        self.assertEqual(self.leftovers(), [])
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_a_child_that_ends_at_term_is_not_killed(self) -> None:
        d = self.start()
        ((transport, _, _, _),) = self.reactor.spawned
        d.cancel()
        transport.exit(None, 15)
        self.failureResultOf(d, CancelledError)
        self.assertEqual(self.reactor.getDelayedCalls(), [])  # the KILL timer is cancelled
        self.assertEqual(transport.signals, ["TERM"])

    def test_refused_before_anything_runs(self) -> None:
        self.failureResultOf(self.start("q9_9"), QuantizeError)
        self.failureResultOf(
            Deferred.fromCoroutine(
                quantize(self.reactor, Path("/q"), self.source, self.source, "q8_0", lambda done, total: None)
            ),
            QuantizeError,
        )
        self.source = make_test_lora(self.dir / "a.gguf")
        self.failureResultOf(self.start(), QuantizeError)
        self.assertEqual(self.reactor.spawned, [])
        self.assertEqual(self.leftovers(), [])
