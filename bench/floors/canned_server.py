"""
The floor of twisted.web itself: a Resource that answers a canned
500-byte reply, no engine.

    canned_server.py PORT
"""

import sys

from twisted.internet import reactor
from twisted.web import resource, server


class Canned(resource.Resource):
    isLeaf = True

    def render_POST(self, request):
        request.content.read()
        request.setHeader(b"content-type", b"application/json")
        return b'{"x":' + b"1" * 500 + b"}"


site = server.Site(Canned())
site.log = lambda request: None
reactor.listenTCP(int(sys.argv[1]), site, interface="127.0.0.1")
reactor.run()
