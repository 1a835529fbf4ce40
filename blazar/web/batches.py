"""
The Batch API surface: OpenAI's C{/v1/files} (upload, list, retrieve,
content, delete) and C{/v1/batches} (create, retrieve, list, cancel).
Decoding and encoding only; what they do is L{blazar.gateway.batch}.

Errors use OpenAI's envelope C{{"error": {"message", "type", "param",
"code"}}}.
"""

from __future__ import annotations

from typing import IO, Any, Callable

import attrs
from klein import Klein
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest

from blazar.gateway.batch import FILE_MAX_BYTES, BatchRunner, FileTooLarge
from blazar.gateway.context import key_of
from blazar.gateway.errors import BadRequest
from blazar.web.body import read_json
from blazar.web.errors import answer
from blazar.web.openai import render
from blazar import strictjson


def thd_read_upload(content: IO[bytes], content_type: str) -> tuple[dict[str, str], tuple[str, bytes] | None]:
    """
    A C{multipart/form-data} upload (RFC 7578, what C{client.files.create}
    sends): its text fields, and its C{file} part's filename and bytes.
    Blocking (reads a body that may be spooled to disk): run it in a
    thread.

    @raise BadRequest: Not multipart, or malformed.
    @raise FileTooLarge: The file part is over L{FILE_MAX_BYTES}.
    """
    import multipart

    kind, options = multipart.parse_options_header(content_type)
    if kind != "multipart/form-data" or not options.get("boundary"):
        raise BadRequest("upload the file as multipart/form-data with a 'file' part and a 'purpose' field, "
                         f"not {kind or 'a body without a content-type'}")
    content.seek(0, 2)
    size = content.tell()
    content.seek(0)
    fields: dict[str, str] = {}
    upload = None
    try:
        parser = multipart.MultipartParser(content, options["boundary"], size, strict=True, part_limit=16,
                                           memory_limit=1024 * 1024, spool_limit=1024 * 1024,
                                           disk_limit=FILE_MAX_BYTES + 1, partsize_limit=FILE_MAX_BYTES + 1)
        for part in parser:
            if part.name == "file":
                if part.size > FILE_MAX_BYTES:
                    raise FileTooLarge(f"a file may be at most 200 MB ({FILE_MAX_BYTES} bytes)", "file")
                upload = (part.filename or "", part.raw)
            elif part.filename is None:
                fields[part.name] = part.value
    except FileTooLarge:
        raise
    except multipart.MultipartError as e:
        if "limit" in str(e).lower():
            raise FileTooLarge(f"a file may be at most 200 MB ({FILE_MAX_BYTES} bytes)", "file") from None
        raise BadRequest(f"malformed multipart/form-data body: {e}") from None
    except (UnicodeError, ValueError, LookupError) as e:
        raise BadRequest(f"malformed multipart/form-data body: {e}") from None
    return fields, upload


def _arg(request: IRequest, name: str) -> str | None:
    values = (request.args or {}).get(name.encode("ascii"))
    return values[-1].decode("utf-8", "replace") if values else None


def _limit(request: IRequest, default: int, most: int) -> int:
    text = _arg(request, "limit")
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise BadRequest(f"'limit' must be an integer from 1 to {most}", "limit")
    return value


def _json(request: IRequest, value: object) -> bytes:
    request.setHeader(b"content-type", b"application/json")
    return strictjson.dumps(value).encode("utf-8")


class BatchSurface:
    """
    OpenAI's Files and Batch API routes.
    """

    app = Klein()

    def __init__(self, batches: BatchRunner, in_thread: Callable[..., Deferred[Any]]) -> None:
        """
        @param batches: What the routes do.
        @param in_thread: Runs a blocking function in a thread pool (the
            upload's multipart parse).
        """
        self.batches = batches
        self.in_thread = in_thread

    @staticmethod
    def _owner(request: IRequest) -> str:
        key = key_of(request)
        return key.name if key is not None else ""

    # -- files -----------------------------------------------------------------

    @app.route("/v1/files", methods=["POST"])
    async def upload(self, request: IRequest) -> bytes:
        header = request.getHeader(b"content-type") or b""
        text = header.decode("latin-1") if isinstance(header, bytes) else str(header)
        fields, upload = await self.in_thread(thd_read_upload, request.content, text)
        if upload is None:
            raise BadRequest("you must provide the file as the 'file' part of the form", "file")
        purpose = fields.get("purpose")
        if not purpose:
            raise BadRequest("missing required parameter 'purpose' (use 'batch')", "purpose")
        return _json(request, await self.batches.upload(self._owner(request), upload[0], purpose, upload[1]))

    @app.route("/v1/files", methods=["GET"])
    async def list_files(self, request: IRequest) -> bytes:
        order = _arg(request, "order") or "desc"
        if order not in ("asc", "desc"):
            raise BadRequest("'order' must be \"asc\" or \"desc\"", "order")
        return _json(request, await self.batches.files(
            self._owner(request), _arg(request, "purpose"), _arg(request, "after"), _limit(request, 10000, 10000),
            order))

    @app.route("/v1/files/<string:file_id>", methods=["GET"])
    async def retrieve_file(self, request: IRequest, file_id: str) -> bytes:
        return _json(request, await self.batches.file(self._owner(request), file_id))

    @app.route("/v1/files/<string:file_id>/content", methods=["GET"])
    async def file_content(self, request: IRequest, file_id: str) -> bytes:
        content = await self.batches.content(self._owner(request), file_id)
        request.setHeader(b"content-type", b"application/octet-stream")
        return content

    @app.route("/v1/files/<string:file_id>", methods=["DELETE"])
    async def delete_file(self, request: IRequest, file_id: str) -> bytes:
        return _json(request, await self.batches.delete_file(self._owner(request), file_id))

    # -- batches ---------------------------------------------------------------

    @app.route("/v1/batches", methods=["POST"])
    async def create_batch(self, request: IRequest) -> bytes:
        return _json(request, await self.batches.create(self._owner(request), read_json(request)))

    @app.route("/v1/batches", methods=["GET"])
    async def list_batches(self, request: IRequest) -> bytes:
        return _json(request, await self.batches.batches(self._owner(request), _arg(request, "after"),
                                                         _limit(request, 20, 100)))

    @app.route("/v1/batches/<string:batch_id>", methods=["GET"])
    async def retrieve_batch(self, request: IRequest, batch_id: str) -> bytes:
        return _json(request, await self.batches.batch(self._owner(request), batch_id))

    @app.route("/v1/batches/<string:batch_id>/cancel", methods=["POST"])
    async def cancel_batch(self, request: IRequest, batch_id: str) -> bytes:
        return _json(request, await self.batches.cancel(self._owner(request), batch_id))

    # -- errors ----------------------------------------------------------------

    @app.handle_errors(Exception)
    def _error(self, request: IRequest, failure: Failure) -> bytes | None:
        problem = answer(request, failure.value, "openai")
        if problem is None:
            return None
        code = getattr(failure.value, "code", None)
        if problem.code is None and isinstance(code, str):
            problem = attrs.evolve(problem, code=code)
        return render(problem)
