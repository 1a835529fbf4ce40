from twisted.trial.unittest import SynchronousTestCase

from blazar.web.sse import ModelRenamer, SSERelay


class RenamerTests(SynchronousTestCase):
    def test_replaces_only_the_model_field(self) -> None:
        r = ModelRenamer("m:latest", "m")
        self.assertEqual(
            r.rename(b'{"model":"m:latest","content":"model m:latest"}'),
            b'{"model":"m","content":"model m:latest"}',
        )

    def test_same_name_is_identity(self) -> None:
        data = b'{"model":"m:latest"}'
        self.assertIs(ModelRenamer("m:latest", "m:latest").rename(data), data)


class RelayTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.out: list[bytes] = []
        self.relay = SSERelay(self.out.append, ModelRenamer("a:latest", "a"))

    def test_events_split_anywhere_are_written_whole(self) -> None:
        stream = b'data: {"model":"a:latest","x":1}\n\ndata: {"model":"a:latest","x":2}\n\ndata: [DONE]\n\n'
        for i in range(len(stream)):
            self.out.clear()
            relay = SSERelay(self.out.append, ModelRenamer("a:latest", "a"))
            relay.feed(stream[:i])
            relay.feed(stream[i:])
            relay.finish()
            self.assertEqual(
                b"".join(self.out),
                b'data: {"model":"a","x":1}\n\ndata: {"model":"a","x":2}\n\ndata: [DONE]\n\n',
            )
            for piece in self.out:
                self.assertTrue(piece.endswith(b"\n\n"), piece)
            self.assertTrue(relay.done)

    def test_fail_adds_error_event_unless_done(self) -> None:
        self.relay.feed(b"data: {}\n\n")
        self.relay.fail(b'{"error":{}}')
        self.assertEqual(self.out[-1], b'data: {"error":{}}\n\n')
        self.assertFalse(self.relay.done)
        done = SSERelay(self.out.append, ModelRenamer("a", "a"))
        done.feed(b"data: [DONE]\n\n")
        before = len(self.out)
        done.fail(b"{}")
        self.assertEqual(len(self.out), before)
