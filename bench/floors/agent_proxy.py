"""
The floor of a twisted.web proxy: a Resource that POSTs the body to the
engine with twisted.web.client.Agent (own pool, kept connections, the
body written at once, as Blazar's engine client does) and writes the reply
back. No logging, no routing, no checks.

    agent_proxy.py ENGINE_PORT ENGINE_KEY PORT
"""

import sys
import warnings

from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred, succeed
from twisted.web import resource, server
from twisted.web.client import Agent, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer
from zope.interface import implementer

# readBody warns about Agent's own transport (no abortConnection): not ours to fix here
warnings.filterwarnings("ignore", category=DeprecationWarning)
engine_port, key, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
pool = HTTPConnectionPool(reactor)
pool.maxPersistentPerHost = 64
agent = Agent(reactor, pool=pool)
url = b"http://127.0.0.1:%d/v1/chat/completions" % engine_port


@implementer(IBodyProducer)
class Body:
    def __init__(self, data: bytes) -> None:
        self.data, self.length = data, len(data)

    def startProducing(self, consumer):
        consumer.write(self.data)
        return succeed(None)

    def pauseProducing(self):
        pass

    def resumeProducing(self):
        pass

    def stopProducing(self):
        pass


class Proxy(resource.Resource):
    isLeaf = True

    def render_POST(self, request):
        body = request.content.read()

        async def forward():
            response = await agent.request(
                b"POST",
                url,
                Headers({b"content-type": [b"application/json"], b"authorization": [b"Bearer " + key.encode()]}),
                Body(body),
            )
            data = await readBody(response)
            request.setHeader(b"content-type", b"application/json")
            request.write(data)
            request.finish()

        ensureDeferred(forward())
        return server.NOT_DONE_YET


site = server.Site(Proxy())
site.log = lambda request: None
reactor.listenTCP(port, site, interface="127.0.0.1")
reactor.run()
