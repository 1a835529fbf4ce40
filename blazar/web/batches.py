"""
The Batch API surface: OpenAI's C{/v1/files} (upload, list, retrieve,
content, delete) and C{/v1/batches} (create, retrieve, list, cancel).
Decoding and encoding only; what they do is L{blazar.gateway.batch}.

Every route counts against its key's C{rpm} (and, as every keyed request
does, holds one of its C{max_concurrent} until its answer is sent: a
download holds it until the last byte); an upload is held to the key's
storage quota (C{file_bytes}, else C{max_file_bytes_per_key}). A file's
content is streamed out in pieces (L{blazar.web.download}), never read
whole.

Errors use OpenAI's envelope C{{"error": {"message", "type", "param",
"code"}}}.
"""

from __future__ import annotations

from typing import IO, Any, Callable

from klein import Klein
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IConsumer
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest

from blazar import strictjson
from blazar.gateway.batch import FILE_MAX_BYTES, BatchRunner, FileTooLarge
from blazar.gateway.context import count_request, key_of
from blazar.gateway.errors import BadRequest
from blazar.web.body import read_json
from blazar.web.client import context_of
from blazar.web.download import FileProducer
from blazar.web.errors import answer, openai_error

log = Logger()


def thd_read_upload(content: IO[bytes], content_type: str) -> tuple[dict[str, str], tuple[str, IO[bytes]] | None]:
    """
    A C{multipart/form-data} upload (RFC 7578, what C{client.files.create}
    sends): its text fields, and its C{file} part's filename and content,
    as a file at its start (spooled to disk past 1 MiB, so a big upload is
    never held in memory; the caller closes it). Blocking (reads a body
    that may be spooled to disk): run it in a thread.

    @raise BadRequest: Not multipart, or malformed.
    @raise FileTooLarge: The file part is over L{FILE_MAX_BYTES}.
    """
    import multipart

    kind, options = multipart.parse_options_header(content_type)
    if kind != "multipart/form-data" or not options.get("boundary"):
        raise BadRequest(
            "upload the file as multipart/form-data with a 'file' part and a 'purpose' field, "
            f"not {kind or 'a body without a content-type'}"
        )
    content.seek(0, 2)
    size = content.tell()
    content.seek(0)
    fields: dict[str, str] = {}
    upload: tuple[str, IO[bytes]] | None = None
    try:
        parser = multipart.MultipartParser(
            content,
            options["boundary"],
            size,
            strict=True,
            part_limit=16,
            memory_limit=1024 * 1024,
            spool_limit=1024 * 1024,
            disk_limit=FILE_MAX_BYTES + 1,
            partsize_limit=FILE_MAX_BYTES + 1,
        )
        for part in parser:
            if part.name == "file":
                if part.size > FILE_MAX_BYTES:
                    raise FileTooLarge(f"a file may be at most 200 MB ({FILE_MAX_BYTES} bytes)", "file")
                if upload is not None:
                    upload[1].close()  # a second file part: the last one counts
                part.file.seek(0)
                upload = (part.filename or "", part.file)
                part.file = None  # it is the caller's now
            elif part.filename is None:
                fields[part.name] = part.value
            else:
                part.close()
    except BaseException as e:
        if upload is not None:
            upload[1].close()
        if isinstance(e, multipart.MultipartError):
            if "limit" in str(e).lower():
                raise FileTooLarge(f"a file may be at most 200 MB ({FILE_MAX_BYTES} bytes)", "file") from None
            raise BadRequest(f"malformed multipart/form-data body: {e}") from None
        if isinstance(e, (UnicodeError, ValueError, LookupError)) and not isinstance(e, BadRequest):
            raise BadRequest(f"malformed multipart/form-data body: {e}") from None
        raise
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
    return strictjson.encode(value).encode("utf-8")


class BatchSurface:
    """
    OpenAI's Files and Batch API routes.
    """

    app = Klein()

    def __init__(self, batches: BatchRunner, in_thread: Callable[..., Deferred[Any]]) -> None:
        """
        @param batches: What the routes do.
        @param in_thread: Runs a blocking function in a thread pool (the
            upload's multipart parse, a download's reads).
        """
        self.batches = batches
        self.in_thread = in_thread

    @staticmethod
    async def _owner(request: IRequest) -> str:
        """
        The key the request runs as (its name; C{""} without keys), its
        C{rpm} checked and counted.

        @raise blazar.gateway.quota.QuotaExceeded: Over rpm.
        """
        await count_request(context_of(request))
        key = key_of(context_of(request))
        return key.owner if key is not None else ""  # (not its name: a later key of the name is not it)

    def _quota(self, request: IRequest) -> int:
        """
        What the request's key's files may hold in all: its C{file_bytes},
        else the live C{max_file_bytes_per_key}.
        """
        key = key_of(context_of(request))
        if key is not None and key.file_bytes is not None:
            return key.file_bytes
        return self.batches.max_file_bytes()

    # -- files -----------------------------------------------------------------

    @app.route("/v1/files", methods=["POST"])
    async def upload(self, request: IRequest) -> bytes:
        owner = await self._owner(request)
        header = request.getHeader(b"content-type") or b""
        text = header.decode("latin-1") if isinstance(header, bytes) else str(header)
        fields, upload = await self.in_thread(thd_read_upload, request.content, text)
        if upload is None:
            raise BadRequest("you must provide the file as the 'file' part of the form", "file")
        filename, content = upload
        try:
            purpose = fields.get("purpose")
            if not purpose:
                raise BadRequest("missing required parameter 'purpose' (use 'batch')", "purpose")
            key = key_of(context_of(request))
            made = await self.batches.upload(
                owner, filename, purpose, content, self._quota(request), key.name if key is not None else ""
            )
        finally:
            # (a spooled part is a temporary file: closing it removes it)
            self.in_thread(content.close).addErrback(lambda f: log.failure("closing an upload failed", f))
        return _json(request, made)

    @app.route("/v1/files", methods=["GET"])
    async def list_files(self, request: IRequest) -> bytes:
        order = _arg(request, "order") or "desc"
        if order not in ("asc", "desc"):
            raise BadRequest('\'order\' must be "asc" or "desc"', "order")
        return _json(
            request,
            await self.batches.files(
                (await self._owner(request)),
                _arg(request, "purpose"),
                _arg(request, "after"),
                _limit(request, 10000, 10000),
                order,
            ),
        )

    @app.route("/v1/files/<string:file_id>", methods=["GET"])
    async def retrieve_file(self, request: IRequest, file_id: str) -> bytes:
        return _json(request, await self.batches.file((await self._owner(request)), file_id))

    @app.route("/v1/files/<string:file_id>/content", methods=["GET"])
    async def file_content(self, request: IRequest, file_id: str) -> bytes | None:
        size, handle = await self.batches.open_content((await self._owner(request)), file_id)
        request.setHeader(b"content-type", b"application/octet-stream")
        request.setHeader(b"content-length", str(size).encode("ascii"))
        await FileProducer(IConsumer(request), handle, self.in_thread).send()
        return None

    @app.route("/v1/files/<string:file_id>", methods=["DELETE"])
    async def delete_file(self, request: IRequest, file_id: str) -> bytes:
        return _json(request, await self.batches.delete_file((await self._owner(request)), file_id))

    # -- batches ---------------------------------------------------------------

    @app.route("/v1/batches", methods=["POST"])
    async def create_batch(self, request: IRequest) -> bytes:
        return _json(request, await self.batches.create((await self._owner(request)), read_json(request)))

    @app.route("/v1/batches", methods=["GET"])
    async def list_batches(self, request: IRequest) -> bytes:
        return _json(
            request,
            await self.batches.batches((await self._owner(request)), _arg(request, "after"), _limit(request, 20, 100)),
        )

    @app.route("/v1/batches/<string:batch_id>", methods=["GET"])
    async def retrieve_batch(self, request: IRequest, batch_id: str) -> bytes:
        return _json(request, await self.batches.batch((await self._owner(request)), batch_id))

    @app.route("/v1/batches/<string:batch_id>/cancel", methods=["POST"])
    async def cancel_batch(self, request: IRequest, batch_id: str) -> bytes:
        return _json(request, await self.batches.cancel((await self._owner(request)), batch_id))

    # -- errors ----------------------------------------------------------------

    @app.handle_errors(Exception)
    def _error(self, request: IRequest, failure: Failure) -> bytes | None:
        problem = answer(request, failure.value, "openai")  # (a BadRequest's code is the table's)
        return None if problem is None else openai_error(problem)
