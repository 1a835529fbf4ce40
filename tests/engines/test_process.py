"""
What of an engine's output a client may see: one sanitized line.
"""

from __future__ import annotations

from typing import Any, cast

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.logger import ILogObserver
from twisted.trial.unittest import SynchronousTestCase

from blazar.engines.process import MAX_LINE, EngineProcessProtocol, sanitize_line


class ErrorLineTests(SynchronousTestCase):
    def protocol(self, *lines: str) -> EngineProcessProtocol:
        p = EngineProcessProtocol("m")
        p.childDataReceived(2, "".join(line + "\n" for line in lines).encode())
        return p

    def test_the_cause_not_the_exit_line(self) -> None:
        p = self.protocol(
            "0.00.009.146 I srv    load_model: loading model '/srv/models/secret/alien.gguf'",
            "0.00.009.756 E llama_model_load: error loading model: unknown model architecture: 'nosucharch'",
            "0.00.011.269 E srv    load_model: failed to load model, '/srv/models/secret/alien.gguf'",
            "0.00.012.127 E srv  llama_server: exiting due to model loading error",
        )
        self.assertEqual(
            p.error_line(),
            "0.00.009.756 E llama_model_load: error loading model: unknown model architecture: 'nosucharch'",
        )

    def test_without_an_error_line_the_last_line(self) -> None:
        self.assertEqual(self.protocol("a", "b").error_line(), "b")
        self.assertEqual(self.protocol().error_line(), "")

    def test_paths_lose_their_directories_and_control_characters_go(self) -> None:
        self.assertEqual(
            sanitize_line("failed to load model, '/srv/models/secret/alien.gguf'\x1b[0m"),
            "failed to load model, 'alien.gguf' [0m",
        )
        self.assertEqual(len(sanitize_line("x" * 1000)), 300)

    def test_model_names_and_urls_are_left_alone(self) -> None:
        self.assertEqual(
            sanitize_line("pulling hf.co/user/repo:tag from http://127.0.0.1:5555/health"),
            "pulling hf.co/user/repo:tag from http://127.0.0.1:5555/health",
        )


class OutputTests(SynchronousTestCase):
    """
    Engine output goes to the per-model ring, not through the daemon's log
    (only warnings and errors are log events).
    """

    def test_every_line_to_the_ring_only_warnings_and_errors_logged(self) -> None:
        from twisted.logger import globalLogPublisher

        from blazar.protocols.control import LogRing

        ring = LogRing()
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(cast(ILogObserver, events.append))
        globalLogPublisher.addObserver(ring)
        self.addCleanup(globalLogPublisher.removeObserver, cast(ILogObserver, events.append))
        self.addCleanup(globalLogPublisher.removeObserver, ring)
        protocol = EngineProcessProtocol("m:latest", output=ring.engine_line)
        protocol.childDataReceived(
            2,
            (
                b"0.00.002.435 I srv  llama_server: initializing\n"
                b"0.00.005.317 W srv  load_model: no chat template\n"
                b"0.00.007.468 E srv  load_model: failed to load\nplain line\n"
            ),
        )
        lines, _ = ring.after(0, "m:latest")
        self.assertEqual(
            lines,
            [
                "m:latest | 0.00.002.435 I srv  llama_server: initializing",
                "m:latest | 0.00.005.317 W srv  load_model: no chat template",
                "m:latest | 0.00.007.468 E srv  load_model: failed to load",
                "m:latest | plain line",
            ],
        )  # each once: the logged warning and error are not added again
        logged = [(e["log_level"].name, e["line"]) for e in events if e.get("model") == "m:latest"]
        self.assertEqual(
            logged,
            [
                ("warn", "0.00.005.317 W srv  load_model: no chat template"),
                ("error", "0.00.007.468 E srv  load_model: failed to load"),
            ],
        )
        self.flushLoggedErrors()
        self.assertEqual(len(protocol.tail), 4)  # the 502 bodies' tail has every line

    def test_without_a_ring_every_line_is_logged(self) -> None:
        from twisted.logger import globalLogPublisher

        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(cast(ILogObserver, events.append))
        self.addCleanup(globalLogPublisher.removeObserver, cast(ILogObserver, events.append))
        EngineProcessProtocol("m").childDataReceived(1, b"0.00.002.435 I srv  hello\n")
        self.assertEqual([e["line"] for e in events if e.get("model") == "m"], ["0.00.002.435 I srv  hello"])

    def test_routine_warnings_stay_in_the_ring(self) -> None:
        """
        A prompt that is all in the KV cache makes llama-server warn twice
        per request: those lines are the ring's alone, other warnings are
        still logged.
        """
        from twisted.logger import globalLogPublisher

        from blazar.protocols.control import LogRing

        ring = LogRing()
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(cast(ILogObserver, events.append))
        self.addCleanup(globalLogPublisher.removeObserver, cast(ILogObserver, events.append))
        EngineProcessProtocol("m", output=ring.engine_line).childDataReceived(
            2,
            (
                b"0.09.376.270 W slot   operator(): id 63 | task 1094 | need to evaluate at least 1 token for each "
                b"active slot (n_past = 21, task.n_tokens() = 21)\n"
                b"0.09.376.270 W slot   operator(): id 63 | task 1094 | n_past was set to 20\n"
                b"0.09.376.300 W srv  operator(): slot 3 context shift disabled\n"
            ),
        )
        self.assertEqual(len(ring.after(0, "m")[0]), 3)
        self.assertEqual(
            [e["line"] for e in events if e.get("model") == "m"],
            ["0.09.376.300 W srv  operator(): slot 3 context shift disabled"],
        )


class CancelledTaskTests(SynchronousTestCase):
    """
    What llama-server reports for a task it stopped because its client
    left (the lines of the pinned engine, ENGINE.md) reaches whoever waits
    for it, in order.
    """

    def feed(self, protocol: EngineProcessProtocol, *lines: str) -> None:
        protocol.childDataReceived(2, "".join(line + "\n" for line in lines).encode())

    def test_a_stopped_tasks_tokens(self) -> None:
        protocol = EngineProcessProtocol("m:latest", output=lambda model, line: None)
        first, second = protocol.next_cancelled(), protocol.next_cancelled()
        self.feed(
            protocol,
            "0.00.571.495 I slot launch_slot_: id  1 | task 5 | processing task, is_child = 0",
            # a task that ends normally is no one's report
            "0.00.600.000 I slot      release: id  0 | task 4 | stop processing: n_tokens = 32, truncated = 0",
            "0.03.071.465 W srv          stop: cancel task, id_task = 5",
            "0.03.086.475 I slot      release: id  1 | task 5 | stop processing: n_tokens = 178, truncated = 0",
        )
        self.assertEqual(self.successResultOf(first), 178)
        self.assertNoResult(second)
        self.feed(
            protocol,
            "0.04.000.000 W srv          stop: cancel task, id_task = 9",
            "0.04.000.100 I slot      release: id  0 | task 9 | stop processing: n_tokens = 40, truncated = 0",
        )
        self.assertEqual(self.successResultOf(second), 40)

    def test_a_wait_given_up_is_not_served(self) -> None:
        protocol = EngineProcessProtocol("m:latest", output=lambda model, line: None)
        gone, kept = protocol.next_cancelled(), protocol.next_cancelled()
        gone.cancel()
        self.failureResultOf(gone)
        self.feed(
            protocol,
            "W srv          stop: cancel task, id_task = 2",
            "I slot      release: id  1 | task 2 | stop processing: n_tokens = 12, truncated = 0",
        )
        self.assertEqual(self.successResultOf(kept), 12)

    def test_a_task_stopped_before_it_had_a_slot_reports_nothing(self) -> None:
        protocol = EngineProcessProtocol("m:latest", output=lambda model, line: None)
        waiting = protocol.next_cancelled()
        self.feed(
            protocol,
            "W srv          stop: cancel task, id_task = 3",
            "I slot      release: id  1 | task 4 | stop processing: n_tokens = 12, truncated = 0",
        )
        self.assertNoResult(waiting)


class LineByLine(EngineProcessProtocol):
    """
    The reading before blocks: every line split off, decoded and searched
    alone.
    """

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        buffered = self._partial.get(childFD, b"") + data
        *lines, rest = buffered.split(b"\n")
        for line in lines:
            self._line(line)
        if len(rest) > MAX_LINE:
            self._line(rest)
            rest = b""
        self._partial[childFD] = rest


class BlockEqualsLineTests(SynchronousTestCase):
    """
    Output read in blocks (each decoded and searched once) reaches the
    ring, the tail, the log and the cancel reports exactly as when every
    line is taken alone, however the child's writes are cut.
    """

    @settings(max_examples=150, deadline=None)
    @given(
        lines=st.lists(
            st.one_of(
                st.sampled_from(
                    [
                        "0.00.002.435 I srv  llama_server: initializing",
                        "0.09.376.270 W slot   operator(): id 63 | task 1094 | n_past was set to 20",
                        "0.00.005.317 W srv  load_model: no chat template",
                        "0.00.007.468 E srv  load_model: failed to load",
                        "srv  cancel_tasks: cancel task, id_task = 7",
                        "slot      release: id  0 | task 7 | stop processing: n_tokens = 12, truncated = 0",
                        "",
                        "\\r",
                        "caf\\u00e9 \\u2603",
                        "x" * 9000,
                    ]
                ),
                st.text(max_size=40),
            ),
            max_size=12,
        ),
        cuts=st.lists(st.integers(min_value=0, max_value=20000), max_size=6),
        crlf=st.booleans(),
    )
    def test_blocks_as_lines(self, lines: list[str], cuts: list[int], crlf: bool) -> None:
        data = "".join(line + ("\r\n" if crlf else "\n") for line in lines).encode("utf-8", "surrogatepass")
        data += b"\xe2\x82"  # an unfinished character, and an unfinished last line

        def run(kind: type[EngineProcessProtocol], pieces: list[bytes]) -> tuple[Any, ...]:
            from twisted.logger import globalLogPublisher

            ring: list[tuple[str, str]] = []
            events: list[dict[str, Any]] = []
            observer = cast(ILogObserver, events.append)
            globalLogPublisher.addObserver(observer)
            try:
                protocol = kind("m", output=lambda model, line: ring.append((model, line)))
                cancelled: list[int] = []
                protocol.next_cancelled().addCallback(cancelled.append)
                for piece in pieces:
                    protocol.childDataReceived(2, piece)
            finally:
                globalLogPublisher.removeObserver(observer)
            logged = [(e["log_level"].name, e["line"]) for e in events if e.get("model") == "m"]
            return ring, list(protocol.tail), logged, cancelled, protocol.unknown_architecture() is None

        bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
        pieces = [data[a:b] for a, b in zip(bounds, bounds[1:])]
        self.assertEqual(run(EngineProcessProtocol, pieces), run(LineByLine, pieces))
        self.flushLoggedErrors()
