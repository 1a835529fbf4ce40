"""
The root resource: one port, several surfaces, chosen by path.
"""

from __future__ import annotations

from typing import Any

from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource


class SurfaceRouter(Resource):
    """
    Sends C{/metrics} (and C{/metrics/models/NAME}) to the Prometheus exposition, C{/ui*} and
    C{/api/logs} to the dashboard (and a browser's C{GET /} there), C{/}
    and C{/api/*} to the Ollama surface, C{/v1/messages*} to the
    Anthropic surface, C{/v1/files*} and C{/v1/batches*} to the Batch API
    (L{blazar.web.batches}), and every other path to the OpenAI surface
    (whose 404 shape unknown paths then get).
    """

    isLeaf = True

    def __init__(
        self,
        openai: IResource,
        ollama: IResource,
        anthropic: IResource,
        metrics: IResource | None = None,
        dashboard: IResource | None = None,
        batches: IResource | None = None,
    ) -> None:
        super().__init__()
        self._batches = batches
        self._metrics = metrics
        self._dashboard = dashboard
        self._openai = openai
        self._ollama = ollama
        self._anthropic = anthropic

    def render(self, request: IRequest) -> Any:
        path = request.path
        if (path == b"/metrics" or path.startswith(b"/metrics/")) and self._metrics is not None:
            return self._metrics.render(request)
        if self._dashboard is not None:
            if path == b"/ui" or path.startswith(b"/ui/") or path == b"/api/logs":
                return self._dashboard.render(request)
            if path == b"/" and request.method in (b"GET", b"HEAD") and _browser(request):
                request.setResponseCode(302)  # a browser at the root gets the dashboard; Ollama clients its line
                request.setHeader(b"location", b"/ui")
                return b""
        if path == b"/" or path.startswith(b"/api/") or path == b"/api":
            return self._ollama.render(request)
        if path == b"/v1/messages" or path.startswith(b"/v1/messages/"):
            return self._anthropic.render(request)
        if self._batches is not None and (
            path in (b"/v1/files", b"/v1/batches") or path.startswith((b"/v1/files/", b"/v1/batches/"))
        ):
            return self._batches.render(request)
        return self._openai.render(request)


def _browser(request: IRequest) -> bool:
    """
    A browser navigating (it asks for HTML first), not an Ollama client
    checking that the server runs.
    """
    accept = request.getHeader(b"accept") or ""
    return "text/html" in (accept if isinstance(accept, str) else accept.decode("latin-1"))
