"""
The floor with a bare-bones HTTP/1.1 client: the same Resource, but the
request to the engine is one pre-built write on a kept connection and the
reply is parsed by hand (Content-Length only: enough for a measurement,
not a client).

    raw_proxy.py ENGINE_PORT ENGINE_KEY PORT
"""

import sys

from twisted.internet import protocol, reactor
from twisted.internet.defer import Deferred
from twisted.web import resource, server

engine_port, key, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
idle: list["Client"] = []


class Client(protocol.Protocol):
    def send(self, data):
        self.buffer, self.done = b"", Deferred()
        self.transport.write(data)
        return self.done

    def connectionLost(self, reason):
        if self in idle:
            idle.remove(self)

    def dataReceived(self, data):
        self.buffer += data
        head, sep, body = self.buffer.partition(b"\r\n\r\n")
        if not sep:
            return
        length = next(
            int(v)
            for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])
            if k.lower() == b"content-length"
        )
        if len(body) >= length:
            idle.append(self)
            self.done.callback(body[:length])


class Proxy(resource.Resource):
    isLeaf = True

    def render_POST(self, request):
        body = request.content.read()
        data = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )

        def reply(payload):
            request.setHeader(b"content-type", b"application/json")
            request.write(payload)
            request.finish()

        def send(client):
            client.send(data).addCallback(reply)

        if idle:
            send(idle.pop())
        else:
            protocol.ClientCreator(reactor, Client).connectTCP("127.0.0.1", engine_port).addCallback(send)
        return server.NOT_DONE_YET


site = server.Site(Proxy())
site.log = lambda request: None
reactor.listenTCP(port, site, interface="127.0.0.1")
reactor.run()
