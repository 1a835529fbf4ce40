"""
The root resource: one port, several surfaces, chosen by path.
"""

from __future__ import annotations

from typing import Any

from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource


class SurfaceRouter(Resource):
    """
    Sends C{/} and C{/api/*} to the Ollama surface, C{/v1/messages*} to the
    Anthropic surface, and every other path to the OpenAI surface (whose 404
    shape unknown paths then get).
    """

    isLeaf = True

    def __init__(self, openai: IResource, ollama: IResource, anthropic: IResource) -> None:
        super().__init__()
        self._openai = openai
        self._ollama = ollama
        self._anthropic = anthropic

    def render(self, request: IRequest) -> Any:  # type: ignore[override]
        path = request.path
        if path == b"/" or path.startswith(b"/api/") or path == b"/api":
            return self._ollama.render(request)
        if path == b"/v1/messages" or path.startswith(b"/v1/messages/"):
            return self._anthropic.render(request)
        return self._openai.render(request)
