"""
The Batch API (OpenAI's C{/v1/files} and C{/v1/batches}): uploaded JSONL
files, batches made from them, and the runner that sends each line through
the daemon's one request path at the lowest priority.

Wire format: OpenAI's Files and Batch API references and its batch guide
(platform.openai.com/docs/guides/batch). Each input line is
C{{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body"}};
each output line is C{{"id": "batch_req_...", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}}; a line that got no
response has C{"response": null, "error": {"code", "message"}}. A line
answered with a status other than 2xx goes to the error file with its
response; the others to the output file.

How lines run (L{BatchRunner}): each is a real HTTP request to the daemon's
own Site over a private UNIX listener (L{LineSender}), carrying a
per-daemon secret (L{SECRET_HEADER}, honoured only on that listener) and
the owning key's name (L{KEY_HEADER}), so the door treats it as that key
(scope, quotas, weight) and it goes through the surface and the pipeline
like any client's request, with C{x-blazar-priority: batch}: it takes a
slot only when nobody else waits. At most C{batch_max_in_flight} lines are
in flight at once, over all batches, oldest batch first.

State is in SQLite (L{blazar.store}, migration 5) and survives restarts;
file contents are files of their own beside it (C{<data_dir>/files/<id>},
migration 7), streamed out in pieces (L{BatchRunner.open_content}).
Each line runs at most once: it is claimed (marked running, with this
node's name, a claim token and a lease of L{LEASE} seconds: migration 9)
before it is sent, and a line found running at start (this node stopped
while it was in flight) is failed with code C{batch_interrupted}, never
sent again. A clean stop waits up to L{STOP_WAIT} seconds for the lines in
flight to finish.

Several nodes on one PostgreSQL store (C{[cluster] database}, issue 42)
share every batch: each node picks up the batches the others made and
claims their pending lines (C{FOR UPDATE SKIP LOCKED}); every
L{TEND_EVERY} seconds it renews the lease of the lines it runs and fails
the lines of a node whose lease ended (it died), never a live node's; a
line's answer is written only while its claim still holds it, so a node
that lost its lease never answers a line twice; and a batch is finalized
(its files written, its final status set) by one node only, under the
batch row's lock (L{thd_finalize}), once no line of it runs anywhere.

Files and batches belong to the key that made them (its name; C{""} on a
gateway without keys): any other key, admin ones included, gets 404, as
with stored Responses API responses.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from io import BytesIO
from pathlib import Path
from typing import IO, Any, Awaitable, BinaryIO, Callable, Mapping

import attrs
from twisted.internet.defer import CancelledError, Deferred, DeferredList, succeed
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from blazar import store, strictjson
from blazar.config import DEFAULT_FILE_BYTES_PER_KEY
from blazar.gateway.errors import BadRequest, NotFound, Unavailable

log = Logger()

FILE_MAX_BYTES = 200 * 1024 * 1024
"""An uploaded file's size, at most: OpenAI's 200 MB."""

FILE_BYTES_SETTING = "max_file_bytes_per_key"
"""The config key of what one key's files may hold in all (C{file_bytes} in its C{[[keys]]} entry overrides it)."""

MAX_LINES = 50_000
"""Requests in one batch, at most (OpenAI's limit)."""

ENDPOINTS = ("/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/v1/completions")
"""What a batch's lines may be sent to."""

WINDOWS = {"24h": 24 * 3600}
"""C{completion_window}s accepted (OpenAI accepts only C{"24h"}), in seconds."""

TERMINAL = ("completed", "failed", "expired", "cancelled")
"""Batch statuses that never change again."""

SECRET_HEADER = b"x-blazar-batch-secret"
"""The per-daemon secret a batch line carries (honoured on the private listener only; never logged)."""

KEY_HEADER = b"x-blazar-batch-key"
"""The name of the API key a batch line runs as (private listener only)."""

PRIORITY = b"batch"
STOP_WAIT = 30.0
"""Seconds a clean stop waits for the lines in flight; those still running then are failed at the next start."""

EXPIRY_CHECK = 60.0
"""Seconds between looks for batches past their C{expires_at}."""

LEASE = 60.0
"""Seconds a node's claim on a line holds unless it renews it: past them, any node takes the line back."""

TEND_EVERY = 10.0
"""Seconds between a node's rounds of lease renewal, take-back of dead nodes' lines and batch pick-up."""

MAX_ERRORS = 100
"""Validation errors listed in a failed batch's C{errors}, at most."""

EXPIRED = {
    "code": "batch_expired",
    "message": "This request could not be executed before the completion window expired.",
}
INTERRUPTED = {
    "code": "batch_interrupted",
    "message": "the node running this request stopped while it was in flight; it may have run, so it is "
    "not sent again (each batch line runs at most once)",
}


class FileNotFound(NotFound):
    """
    No file with that id for this key (404; never says whether another key
    has one).
    """


class BatchNotFound(NotFound):
    """
    No batch with that id for this key (404).
    """


class BatchConflict(BadRequest):
    """
    The batch is in a status that does not allow this (409), e.g. cancelling
    a completed batch.
    """

    status = 409


class FileTooLarge(BadRequest):
    """
    An upload over L{FILE_MAX_BYTES} (413).
    """

    status = 413
    code = "file_too_large"


class StorageQuotaExceeded(BadRequest):
    """
    An upload that would take its key's files past the key's storage quota
    (413 C{storage_quota_exceeded}); the message names the setting and
    the fix.
    """

    status = 413
    code = "storage_quota_exceeded"


def storage_refusal(key: str, used: int, size: int, quota: int) -> StorageQuotaExceeded:
    """
    The L{StorageQuotaExceeded} for key C{key} (C{""}: a gateway without
    keys) whose files hold C{used} bytes, refused a C{size}-byte file.
    """
    whose = f"key {key!r}'s files hold" if key else "the files stored on this gateway (it has no keys) hold"
    setting = (
        f"{FILE_BYTES_SETTING} in the config, or file_bytes in the key's [[keys]] entry"
        if key
        else f"{FILE_BYTES_SETTING} in the config"
    )
    return StorageQuotaExceeded(
        f"{whose} {used} bytes; this {size}-byte file would take them past the quota of {quota} bytes "
        f"({setting}): delete files no longer needed with DELETE /v1/files/{{file_id}} (GET /v1/files lists "
        "them; a finished batch's output and error files count too), or raise the quota",
        "file",
    )


def new_id(prefix: str) -> str:
    """
    A new object id: C{file-<24 hex>}, C{batch_<24 hex>}.
    """
    return prefix + secrets.token_hex(12)


def file_object(row: tuple[str, str, str, str, int, int]) -> dict[str, Any]:
    """
    OpenAI's file object (C{openai.types.FileObject}) for a
    C{(id, key, filename, purpose, created_at, bytes)} row.
    """
    id_, _, filename, purpose, created_at, size = row
    return {
        "id": id_,
        "object": "file",
        "bytes": size,
        "created_at": created_at,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def list_page(page: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """
    OpenAI's cursor page of objects (files, batches): C{object: "list"},
    C{data}, the C{first_id} and C{last_id} of C{page} (L{None} when it
    is empty) and C{has_more}.
    """
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": has_more,
    }


def check_metadata(value: object) -> dict[str, str] | None:
    """
    A batch's C{metadata}: at most 16 string pairs, keys up to 64
    characters, values up to 512 (OpenAI's rule).

    @raise BadRequest: Anything else.
    """
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > 16
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()
        )
    ):
        raise BadRequest(
            "'metadata' must be an object of at most 16 string pairs (keys up to 64 characters, values up to 512)",
            "metadata",
        )
    return dict(value)


def _disk_full(error: BaseException) -> bool:
    """
    Whether a write failed for want of space (SQLite's own words for it,
    or the kernel's ENOSPC / EDQUOT).
    """
    import errno

    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "disk is full" in str(error) or "disk full" in str(error)


def _is_text(value: str) -> bool:
    """
    Whether C{value} is text UTF-8 can hold (no lone surrogate, which a
    JSON C{\\ud800} escape can make).
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def new_batch(
    id_: str, endpoint: str, input_file_id: str, window: str, now: int, metadata: dict[str, str] | None
) -> dict[str, Any]:
    """
    A new batch object in OpenAI's shape (C{openai.types.Batch}), status
    C{validating}, every timestamp but C{created_at} and C{expires_at}
    null.
    """
    return {
        "id": id_,
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + WINDOWS[window],
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
        "model": None,
    }


def _error(code: str, message: str, line: int | None, param: str | None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def parse_input(content: bytes, endpoint: str) -> tuple[list[tuple[str, str]], list[dict[str, Any]], str | None]:
    """
    Validate a batch's input file (JSONL). Pure and CPU-bound: run it in
    a thread for a big file.

    Each non-blank line must be a JSON object with a non-empty string
    C{custom_id} (unique in the file), C{method} C{"POST"}, C{url} equal
    to C{endpoint} and an object C{body} that does not ask to stream.

    @return: The lines' C{(custom_id, body JSON)} in order; the errors
        found (OpenAI's C{BatchError}s: C{code}, C{message}, C{param},
        C{line}, 1-based; at most L{MAX_ERRORS}); and the one C{model}
        every line names, else L{None}.
    """
    lines: list[tuple[str, str]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    models: set[object] = set()

    def fail(code: str, message: str, line: int | None, param: str | None = None) -> None:
        if len(errors) < MAX_ERRORS:
            errors.append(_error(code, message, line, param))

    for n, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            fail("invalid_json_line", f"line {n} is not valid JSON", n)
            continue
        if not isinstance(item, dict):
            fail("invalid_json_line", f"line {n} is not a JSON object", n)
            continue
        custom_id, body = item.get("custom_id"), item.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            fail("missing_required_parameter", f"line {n} has no 'custom_id' (a non-empty string)", n, "custom_id")
            continue
        if custom_id in seen:
            fail(
                "duplicate_custom_id",
                f"line {n}: custom_id {custom_id[:100]!r} is used by an earlier line; "
                "each custom_id must be unique within the batch",
                n,
                "custom_id",
            )
            continue
        seen.add(custom_id)
        if item.get("method") != "POST":
            fail("invalid_method", f"line {n}: 'method' must be \"POST\"", n, "method")
            continue
        if item.get("url") != endpoint:
            fail("invalid_url", f"line {n}: 'url' must be the batch's endpoint {endpoint!r}", n, "url")
            continue
        if not isinstance(body, dict):
            fail("missing_required_parameter", f"line {n} has no 'body' (the request, a JSON object)", n, "body")
            continue
        if body.get("stream"):
            fail("invalid_value", f"line {n}: batch requests cannot stream; drop 'stream'", n, "body.stream")
            continue
        models.add(body.get("model"))
        lines.append((custom_id, strictjson.encode(body)))
    if not lines and not errors:
        fail("empty_file", "the input file has no requests", None)
    if len(lines) > MAX_LINES:
        fail("too_many_requests", f"a batch may have at most {MAX_LINES} requests; this file has {len(lines)}", None)
    model = next(iter(models)) if len(models) == 1 else None
    return lines, errors, model if isinstance(model, str) else None


def output_line(batch: str, line: int, custom_id: str, status: int, request_id: str, body: object) -> dict[str, Any]:
    """
    The output (or error) file line of a request that got a response.
    """
    return {
        "id": store.line_request_id(batch, line),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(batch: str, line: int, custom_id: str, code: str, message: str) -> dict[str, Any]:
    """
    The error file line of a request that got no response.
    """
    return {
        "id": store.line_request_id(batch, line),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def error_template(error: Mapping[str, str]) -> str:
    """
    An error line with its C{id} and C{custom_id} left for the store to
    fill in per line (L{store.thd_interrupted_lines}, L{store.thd_fail_pending}).
    """
    return strictjson.encode({"id": None, "custom_id": None, "response": None, "error": dict(error)})


def thd_record_line(
    db: store.Database, batch: str, line: int, ok: bool, result: str, batch_json: str, claim: str | None = None
) -> bool:
    """
    Record a line's outcome and the batch's new counts, in one transaction:
    only while the line is still C{claim}'s (L{store.thd_finish_line}).

    @return: Whether it was recorded (else another node took the line
        back: its answer is dropped, never written twice).
    """
    with store.transaction(db):
        if not store.thd_finish_line(db, batch, line, ok, result, claim):
            return False
        store.thd_put_batch(db, batch, batch_json)
        return True


def thd_finalize(db: store.Database, batch: dict[str, Any], key: str, now: int) -> dict[str, Any] | None:
    """
    Write a finished batch's output and error files (purpose
    C{batch_output}, owned by C{key}; none when empty) and its final
    object, its C{request_counts} counted from its lines, in one transaction (a crash never leaves the files without
    the batch naming them).

    Exactly once across nodes: the batch's row is locked first (C{FOR
    UPDATE} on PostgreSQL, the write lock on SQLite), and a batch already
    final (another node finalized it) is returned as it is stored. A
    C{cancelling} one stored is finalized C{cancelled} whatever this node
    thought.

    @param batch: The batch object, its final status and timestamp set.
    @return: It with C{output_file_id} and C{error_file_id} filled in; the
        stored object if another node finalized it; L{None} if not yet:
        some line still runs (on another node), or, for a C{completed}
        one, is pending again.
    """
    written: list[str] = []
    try:
        with store.transaction(db, "BEGIN IMMEDIATE"):
            lock = " FOR UPDATE" if store.is_postgres(db) else ""
            row = db.execute(f"SELECT batch FROM batches WHERE id = ?{lock}", (batch["id"],)).fetchone()
            stored: dict[str, Any] = json.loads(row[0]) if row is not None else {}
            if stored.get("status") in TERMINAL:
                return stored
            counts = store.thd_line_counts(db, batch["id"])
            if counts.get("running") or (counts.get("pending") and batch["status"] == "completed"):
                return None
            if stored.get("status") == "cancelling" and batch["status"] != "cancelled":
                batch = {k: v for k, v in batch.items() if k not in ("completed_at", "expired_at")}
                batch.update(status="cancelled", cancelled_at=now)
            batch = {
                **batch,
                "request_counts": {
                    "total": sum(counts.values()),
                    "completed": counts.get("done", 0),
                    "failed": counts.get("failed", 0),
                },
            }
            for ok, field, suffix in ((True, "output_file_id", "output"), (False, "error_file_id", "error")):
                content = store.thd_results(db, batch["id"], ok)
                if content:
                    file_id = new_id("file-")
                    store.thd_put_file(
                        db, (file_id, key, f"{batch['id']}_{suffix}.jsonl", "batch_output", now, content)
                    )
                    written.append(file_id)
                    batch = {**batch, field: file_id}
            store.thd_put_batch(db, batch["id"], strictjson.encode(batch))
    except BaseException:
        for file_id in written:  # their rows are gone with the transaction
            store.thd_remove_content(db, file_id)
        raise
    return batch


def thd_unfinished(db: store.Database) -> list[tuple[str, str]]:
    """
    C{(key, batch JSON)} of every batch not in a L{TERMINAL} status,
    oldest first.
    """
    marks = ", ".join("?" * len(TERMINAL))
    status = store.batch_status_sql(db)
    return [
        (str(k), str(b))
        for k, b in db.execute(
            f"SELECT key, batch FROM batches WHERE {status} NOT IN ({marks}) ORDER BY created_at, id",
            TERMINAL,
        )
    ]


#: (key name, endpoint, body, trace id) -> (status, lower-cased headers, body)
Send = Callable[[str, str, bytes, str], Awaitable[tuple[int, Mapping[str, str], bytes]]]
RunDB = Callable[..., Deferred[Any]]
InThread = Callable[..., Deferred[Any]]


@attrs.define(eq=False)
class _Running:
    """
    A batch the runner is working on.

    @ivar exhausted: No pending line was left at the last claim.
    @ivar expiring: Its window passed: its pending lines were failed.
    """

    key: str
    batch: dict[str, Any]
    in_flight: int = 0
    exhausted: bool = False
    expiring: bool = False
    paused_until: float = 0.0
    finishing: bool = False
    claiming: bool = False

    @property
    def id(self) -> str:
        return str(self.batch["id"])


@attrs.define(eq=False)
class BatchRunner:
    """
    The Batch API's operations (what the C{/v1/files} and C{/v1/batches}
    routes call) and the runner of its lines (see the module docstring).

    @ivar reactor: Its C{seconds()} is the UNIX time the objects show,
        and its C{callLater} the runner's timers.
    @ivar run_db: Runs a C{thd_*} function of L{blazar.store} (or of this
        module) with the database on the store's thread.
    @ivar in_thread: Runs a CPU-bound function (L{parse_input}) in a
        thread pool.
    @ivar send: Sends one line through the daemon's own Site
        (L{LineSender.send}).
    @ivar max_in_flight: Lines in flight at once, at most (the live
        C{batch_max_in_flight}).
    @ivar max_file_bytes: What a key's files may hold in all, unless its
        C{file_bytes} says (the live C{max_file_bytes_per_key}).
    @ivar node: This node's name (L{blazar.config.node_name}), recorded
        as the owner of the lines it claims.
    @ivar lease: Seconds its claims hold unless renewed (every
        L{TEND_EVERY} seconds while it runs).
    """

    reactor: Any
    run_db: RunDB
    in_thread: InThread
    send: Send
    max_in_flight: Callable[[], int]
    max_file_bytes: Callable[[], int] = lambda: DEFAULT_FILE_BYTES_PER_KEY
    node: str = "local"
    lease: float = LEASE
    _tender: LoopingCall | None = None
    _tending: bool = False
    _active: dict[str, _Running] = attrs.field(factory=dict)
    _lines: set[Deferred[None]] = attrs.field(factory=set)
    _in_flight: int = 0
    _pumping: bool = False
    _again: bool = False
    _stopping: bool = False
    _expiry: LoopingCall | None = None
    _timers: list[IDelayedCall] = attrs.field(factory=list)
    # why lines cannot run on this daemon (its private listener could not be made), or None
    unavailable: str | None = None

    def _now(self) -> int:
        return int(self.reactor.seconds())

    # -- files -----------------------------------------------------------------

    async def upload(
        self,
        key: str,
        filename: str,
        purpose: str,
        content: bytes | IO[bytes],
        quota: int | None = None,
        name: str | None = None,
    ) -> dict[str, Any]:
        """
        Store an uploaded file.

        @param content: Its bytes, or a readable file holding them (read
            in pieces on the store's thread; the caller closes it).
        @param quota: The bytes C{key}'s files may hold in all, if limited.
        @param name: The key's name, as a refusal names it (C{key} unless
            given: C{key} is its owner, which may carry its id).
        @return: Its file object.
        @raise BadRequest: A purpose other than C{batch}.
        @raise FileTooLarge: Over L{FILE_MAX_BYTES}.
        @raise StorageQuotaExceeded: It would take C{key}'s files past C{quota}.
        """
        if purpose != "batch":
            raise BadRequest(
                f"purpose {purpose[:50]!r} is not supported here: this gateway takes files for the "
                "Batch API only (purpose 'batch')",
                "purpose",
            )
        if isinstance(content, bytes) and len(content) > FILE_MAX_BYTES:
            raise FileTooLarge(
                f"the file is {len(content)} bytes; a file may be at most 200 MB ({FILE_MAX_BYTES} bytes)", "file"
            )
        row = (new_id("file-"), key, filename or "upload.jsonl", purpose, self._now(), content)
        try:
            size = await self.run_db(store.thd_put_file, row, quota)
        except store.OverQuota as e:
            raise storage_refusal(key if name is None else name, e.used, e.size, e.quota) from None
        except (sqlite3.OperationalError, OSError) as e:
            if not _disk_full(e):
                raise
            raise Unavailable(
                "the disk that holds the daemon's data_dir is full: the file was not stored; free "
                "space there, or move data_dir to a larger disk"
            ) from None
        return file_object((*row[:5], int(size)))

    async def files(
        self, key: str, purpose: str | None = None, after: str | None = None, limit: int = 10000, order: str = "desc"
    ) -> dict[str, Any]:
        """
        C{key}'s files, OpenAI's list object (C{data}, C{first_id},
        C{last_id}, C{has_more}): newest first (C{order="asc"}: oldest),
        starting after file C{after}.
        """
        rows = await self.run_db(store.thd_files, key)
        if order == "asc":
            rows.reverse()
        if purpose is not None:
            rows = [r for r in rows if r[3] == purpose]
        if after is not None:
            ids = [r[0] for r in rows]
            rows = rows[ids.index(after) + 1 :] if after in ids else rows
        return list_page([file_object(r) for r in rows[:limit]], len(rows) > limit)

    async def file(self, key: str, file_id: str) -> dict[str, Any]:
        """
        @raise FileNotFound: None of C{key}'s.
        """
        row = await self.run_db(store.thd_file, file_id, key)
        if row is None:
            raise _no_file(file_id)
        return file_object(row)

    async def content(self, key: str, file_id: str) -> bytes:
        """
        A file's bytes, whole (L{open_content} reads them in pieces).

        @raise FileNotFound: None of C{key}'s.
        """
        content = await self.run_db(store.thd_file_content, file_id, key)
        if content is None:
            raise _no_file(file_id)
        return bytes(content)

    async def open_content(self, key: str, file_id: str) -> tuple[int, BinaryIO]:
        """
        A file's content, opened for reading (a delete meanwhile does not
        cut the reading short).

        @return: Its size in bytes, and the open file: the caller reads it
            off the reactor thread, and closes it.
        @raise FileNotFound: None of C{key}'s.
        """
        found = await self.run_db(store.thd_open_content, file_id, key)
        if found is None:
            raise _no_file(file_id)
        size, handle = found
        return int(size), handle

    async def delete_file(self, key: str, file_id: str) -> dict[str, Any]:
        """
        Delete one of C{key}'s files (a running batch has its lines already:
        deleting its input file does not stop it).

        @raise FileNotFound: None of C{key}'s.
        """
        if not await self.run_db(store.thd_delete_file, file_id, key):
            raise _no_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # -- batches ---------------------------------------------------------------

    async def create(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        """
        Make a batch from C{body} (C{input_file_id}, C{endpoint},
        C{completion_window}, C{metadata}). Its input is validated at
        once: the batch comes back C{in_progress}, or C{failed} with
        C{errors} when a line is malformed (no line then runs).

        @raise BadRequest: A missing or unsupported parameter.
        @raise FileNotFound: The input file is none of C{key}'s.
        @raise Unavailable: Lines cannot run on this daemon (L{unavailable}).
        """
        if self.unavailable is not None:
            raise Unavailable(self.unavailable)
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str) or not file_id:
            raise BadRequest("missing required parameter 'input_file_id'", "input_file_id")
        if not _is_text(file_id):  # (a lone surrogate: no id can hold it, and SQLite cannot take it)
            raise _no_file(file_id.encode("utf-8", "replace").decode("utf-8"), "input_file_id")
        endpoint = body.get("endpoint")
        if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
            raise BadRequest(f"'endpoint' must be one of {', '.join(ENDPOINTS)}", "endpoint")
        window = body.get("completion_window")
        if not isinstance(window, str) or window not in WINDOWS:
            raise BadRequest("'completion_window' must be \"24h\"", "completion_window")
        metadata = check_metadata(body.get("metadata"))
        row = await self.run_db(store.thd_file, file_id, key)
        if row is None:
            raise _no_file(file_id, "input_file_id")
        if row[3] != "batch":
            raise BadRequest(
                f"file {file_id!r} has purpose {row[3]!r}; a batch's input file must be uploaded with purpose 'batch'",
                "input_file_id",
            )
        content = await self.run_db(store.thd_file_content, file_id, key)
        lines, errors, model = await self.in_thread(parse_input, bytes(content or b""), endpoint)
        now = self._now()
        batch = new_batch(new_id("batch_"), str(endpoint), file_id, str(window), now, metadata)
        batch["model"] = model
        if errors:
            batch.update(status="failed", failed_at=now, errors={"object": "list", "data": errors})
            lines = []
        else:
            batch.update(
                status="in_progress",
                in_progress_at=now,
                request_counts={"total": len(lines), "completed": 0, "failed": 0},
            )
        await self.run_db(store.thd_create_batch, batch["id"], key, now, strictjson.encode(batch), lines)
        if errors:
            log.info("batch {batch} failed validation: {count} errors", batch=batch["id"], count=len(errors))
        else:
            log.info(
                "batch {batch}: {lines} lines to {endpoint}", batch=batch["id"], lines=len(lines), endpoint=endpoint
            )
            self._active[batch["id"]] = _Running(key, batch)
            self._kick()
        return dict(batch)

    async def batch(self, key: str, batch_id: str) -> dict[str, Any]:
        """
        @raise BatchNotFound: None of C{key}'s.
        """
        text = await self.run_db(store.thd_batch, batch_id, key)
        if text is None:
            raise _no_batch(batch_id)
        return await self._counted(json.loads(text))

    async def _counted(self, batch: dict[str, Any]) -> dict[str, Any]:
        """
        C{batch} with its C{request_counts} counted from its lines while
        it runs: the stored ones are the last writer's, and on a shared
        store each node knows only its own lines' outcomes.
        """
        if batch.get("status") in TERMINAL or "request_counts" not in batch:
            return batch
        counts = await self.run_db(store.thd_line_counts, batch["id"])
        batch["request_counts"] = {
            "total": sum(counts.values()),
            "completed": counts.get("done", 0),
            "failed": counts.get("failed", 0),
        }
        return batch

    async def batches(self, key: str, after: str | None = None, limit: int = 20) -> dict[str, Any]:
        """
        C{key}'s batches, newest first, OpenAI's cursor page.
        """
        rows = await self.run_db(store.thd_batches, key, after, limit + 1)
        return list_page([await self._counted(json.loads(b)) for _, b in rows[:limit]], len(rows) > limit)

    async def cancel(self, key: str, batch_id: str) -> dict[str, Any]:
        """
        Cancel a batch: it is C{cancelling} until its lines in flight have
        finished, then C{cancelled}; its pending lines never start (they
        are in neither file, and not counted as failed).

        @return: The batch, C{cancelling} (or as it was, if already
            cancelling or cancelled).
        @raise BatchNotFound: None of C{key}'s.
        @raise BatchConflict: It has completed, failed or expired.
        """
        batch = await self.batch(key, batch_id)
        if batch["status"] in ("cancelling", "cancelled"):
            return batch
        running = self._active.get(batch_id)
        if running is None and batch["status"] not in TERMINAL:
            # made on another node since this one last looked: this node takes the cancel
            running = self._active[batch_id] = _Running(key, batch)
        if batch["status"] in TERMINAL or running is None:
            raise BatchConflict(f"batch {batch_id!r} is {batch['status']}: it cannot be cancelled")
        running.batch.update(status="cancelling", cancelling_at=self._now())
        await self._save(running)
        if running.in_flight == 0:
            self._finish_later(running)
        return dict(running.batch)

    # -- the runner ----------------------------------------------------------

    async def start(self) -> None:
        """
        Resume the unfinished batches, this node's and every other's: each
        line this node's earlier life left running (or another node left
        running past its lease) is failed (C{batch_interrupted}: it is
        not sent again), the counts are rebuilt from the lines, and the
        pending lines run. Then, every L{TEND_EVERY} seconds, L{_tend}.
        """
        self._stopping = False
        swept = await self.run_db(store.thd_sweep_files)
        if swept:
            log.info("removed {count} file contents no file row named (left by an unclean stop)", count=swept)
        taken = await self.run_db(
            store.thd_take_back_lines, self.reactor.seconds(), error_template(INTERRUPTED), self.node
        )
        for key, text in await self.run_db(thd_unfinished):
            batch = json.loads(text)
            if batch["id"] in self._active:
                continue  # made since this start began
            counts = await self.run_db(store.thd_line_counts, batch["id"])
            batch["request_counts"] = {
                "total": sum(counts.values()),
                "completed": counts.get("done", 0),
                "failed": counts.get("failed", 0),
            }
            running = self._active[batch["id"]] = _Running(key, batch)
            await self._save(running)
            log.info(
                "batch {batch} resumed ({status}): {pending} lines pending, {interrupted} were in flight at the "
                "last stop and are failed, not sent again",
                batch=batch["id"],
                status=batch["status"],
                pending=counts.get("pending", 0),
                interrupted=taken.get(batch["id"], 0),
            )
            if batch["status"] in ("cancelling", "finalizing"):
                self._finish_later(running)
        self._expiry = LoopingCall(self._expire)
        self._expiry.clock = self.reactor
        self._expiry.start(EXPIRY_CHECK, now=True).addErrback(lambda f: log.failure("batch expiry stopped", f))
        self._tender = LoopingCall(self._tend)
        self._tender.clock = self.reactor
        self._tender.start(TEND_EVERY, now=False).addErrback(lambda f: log.failure("batch tending stopped", f))
        self._kick()

    def _tend(self) -> None:
        """
        The periodic job (L{TEND_EVERY}): one L{_tend_round} at a time.
        """
        if self._tending or self._stopping:
            return
        self._tending = True

        def done(result: object) -> None:
            self._tending = False

        try:
            d = Deferred.fromCoroutine(self._tend_round())
        except Exception:
            self._tending = False
            log.failure("tending the batches failed")
            return
        d.addErrback(lambda f: log.failure("tending the batches failed", f)).addBoth(done)

    async def _tend_round(self) -> None:
        """
        Renew the lease of the lines this node runs; take back the lines
        of nodes whose lease ended (failed, never sent again); pick up the
        batches other nodes made (any node runs any batch's lines) and
        the cancels they took; and look again for lines to run and
        batches to finish.
        """
        now = self.reactor.seconds()
        await self.run_db(store.thd_renew_leases, self.node, now + self.lease)
        taken = await self.run_db(store.thd_take_back_lines, now, error_template(INTERRUPTED), None)
        for batch_id, count in taken.items():
            log.info(
                "batch {batch}: {count} lines were in flight on a node whose lease ended; they are failed, "
                "not sent again",
                batch=batch_id,
                count=count,
            )
        for key, text in await self.run_db(thd_unfinished):
            batch = json.loads(text)
            running = self._active.get(batch["id"])
            if running is None:
                self._active[batch["id"]] = _Running(key, batch)
                log.info(
                    "batch {batch} ({status}) picked up from another node", batch=batch["id"], status=batch["status"]
                )
            elif batch["status"] == "cancelling" and running.batch["status"] == "in_progress":
                running.batch.update(status="cancelling", cancelling_at=batch.get("cancelling_at"))
        for running in list(self._active.values()):
            if running.in_flight == 0 and not running.finishing and not running.claiming:
                if running.batch["status"] == "in_progress" and not running.expiring:
                    running.exhausted = False  # lines put back, or a batch others still run: look again
                else:
                    self._finish_later(running)
        self._kick()

    async def stop(self) -> None:
        """
        Start no more lines; wait up to L{STOP_WAIT} seconds for those in
        flight (the rest are cancelled, and failed at the next start).
        """
        self._stopping = True
        for job in (self._expiry, self._tender):
            if job is not None and job.running:
                job.stop()
        for timer in self._timers:
            if timer.active():
                timer.cancel()
        self._timers.clear()
        lines = list(self._lines)
        if not lines:
            return
        log.info("waiting up to {secs} s for {count} batch lines in flight", secs=STOP_WAIT, count=len(lines))

        def cut_short() -> None:
            for d in lines:
                d.cancel()

        timer = self.reactor.callLater(STOP_WAIT, cut_short)
        await DeferredList(lines, consumeErrors=True)
        if timer.active():
            timer.cancel()

    @property
    def stopping(self) -> bool:
        """
        Whether L{stop} was called (no line starts any more).
        """
        return self._stopping

    def drained(self) -> Deferred[None]:
        """
        Fires when the lines in flight now have ended (recorded, or cut
        short by L{stop}'s bound).
        """
        lines = list(self._lines)
        if not lines:
            return succeed(None)
        return DeferredList(lines, consumeErrors=True).addCallback(lambda _: None)

    def _later(self, delay: float, f: Callable[[], object]) -> None:
        self._timers = [t for t in self._timers if t.active()]
        self._timers.append(self.reactor.callLater(delay, f))

    def _kick(self) -> None:
        """
        Start lines while there is room (one pump at a time; a kick during
        a pump makes it go round again).
        """
        if self._stopping:
            return
        if self._pumping:
            self._again = True
            return
        Deferred.fromCoroutine(self._pump()).addErrback(lambda f: log.failure("batch runner failed", f))

    async def _pump(self) -> None:
        self._pumping = True
        try:
            self._again = True
            while self._again and not self._stopping:
                self._again = False
                for running in list(self._active.values()):
                    free = self.max_in_flight() - self._in_flight
                    if free <= 0 or self._stopping:
                        break
                    if (
                        running.batch["status"] != "in_progress"
                        or running.exhausted
                        or running.finishing
                        or running.paused_until > self.reactor.seconds()
                    ):
                        continue
                    running.claiming = True
                    claim = f"{self.node}:{secrets.token_hex(8)}"
                    try:
                        rows = await self.run_db(
                            store.thd_claim_lines,
                            running.id,
                            free,
                            self.node,
                            claim,
                            self.reactor.seconds() + self.lease,
                        )
                        if len(rows) < free:
                            running.exhausted = True
                        if running.batch["status"] != "in_progress" or running.expiring or self._stopping:
                            # cancelled, expired or stopped while the claim ran: those never start
                            await self._unclaim(running, [row[0] for row in rows], claim)
                            rows = []
                    finally:
                        running.claiming = False
                    for line, custom_id, body in rows:
                        self._start_line(running, line, custom_id, body, claim)
                    if running.in_flight == 0 and (running.exhausted or running.batch["status"] == "cancelling"):
                        self._finish_later(running)
        finally:
            self._pumping = False

    async def _unclaim(self, running: _Running, lines: list[int], claim: str) -> None:
        """
        Put claimed lines that were not sent back to pending (an expiring
        batch's then fail as expired, as its other pending ones did).
        """
        for line in lines:
            await self.run_db(store.thd_release_line, running.id, line, claim)
        if lines and running.expiring:
            failed = await self.run_db(store.thd_fail_pending, running.id, error_template(EXPIRED))
            counts = running.batch["request_counts"]
            running.batch["request_counts"] = {**counts, "failed": counts["failed"] + failed}
            await self._save(running)

    def _start_line(self, running: _Running, line: int, custom_id: str, body: str, claim: str) -> None:
        running.in_flight += 1
        self._in_flight += 1
        d = Deferred.fromCoroutine(self._run_line(running, line, custom_id, body, claim))
        self._lines.add(d)
        d.addBoth(lambda _: self._lines.discard(d))

    async def _run_line(self, running: _Running, line: int, custom_id: str, body: str, claim: str) -> None:
        try:
            await self._send_line(running, line, custom_id, body, claim)
        except CancelledError:
            # a stop that could not wait: it stays running, and the next start fails it
            log.info("batch {batch} line {line} cut short by the stop", batch=running.id, line=line)
        except Exception:
            log.failure("batch {batch} line {line} failed", batch=running.id, line=line)
        # (not in a finally: a coroutine dropped unfinished must not start more)
        running.in_flight -= 1
        self._in_flight -= 1
        if not self._stopping:
            if running.in_flight == 0 and (running.exhausted or running.batch["status"] == "cancelling"):
                self._finish_later(running)
            self._kick()

    async def _send_line(self, running: _Running, line: int, custom_id: str, body: str, claim: str) -> None:
        trace = f"{running.id}.{line}"
        try:
            status, headers, payload = await self.send(
                running.key, running.batch["endpoint"], body.encode("utf-8"), trace
            )
        except CancelledError:
            raise
        except Exception as e:
            ok, result = (
                False,
                error_line(running.id, line, custom_id, "request_failed", f"the request could not be sent: {e}"),
            )
        else:
            wait = _retry_after(headers) if status in (429, 503) else None
            if wait is not None and not running.expiring:
                # refused before any engine saw it (a quota, a full queue,
                # an open breaker): it goes back to pending, the batch waits
                await self.run_db(store.thd_release_line, running.id, line, claim)
                running.exhausted = False
                running.paused_until = max(running.paused_until, self.reactor.seconds() + wait)
                self._later(wait, self._kick)
                return
            ok = 200 <= status < 300
            result = output_line(
                running.id, line, custom_id, status, headers.get("x-blazar-trace-id", trace), _body_of(payload)
            )
        counts = running.batch["request_counts"]
        running.batch["request_counts"] = {
            **counts,
            "completed": counts["completed"] + ok,
            "failed": counts["failed"] + (not ok),
        }
        recorded = await self.run_db(
            thd_record_line, running.id, line, ok, strictjson.encode(result), strictjson.encode(running.batch), claim
        )
        if not recorded:
            running.batch["request_counts"] = counts
            log.warn(
                "batch {batch} line {line}: its lease ended and another node took it back (failed it); this "
                "answer is dropped, never written twice",
                batch=running.id,
                line=line,
            )

    def _finish_later(self, running: _Running) -> None:
        if running.finishing or running.claiming or self._stopping:
            return  # (a claim in progress finishes it when it is done)
        running.finishing = True
        Deferred.fromCoroutine(self._finish(running)).addErrback(
            lambda f: log.failure("finishing batch {batch} failed", f, batch=running.id)
        )

    async def _finish(self, running: _Running) -> None:
        """
        A batch with nothing left in flight here: C{cancelling} becomes
        C{cancelled}, an expired one C{expired}, else C{completed}
        (C{finalizing_at} set); its output and error files are written,
        by one node only (L{thd_finalize}). While another node still runs
        some of its lines, it waits for the next L{_tend} round.
        """
        try:
            batch, now = running.batch, self._now()
            if batch["status"] == "cancelling":
                final = {"status": "cancelled", "cancelled_at": now}
            elif running.expiring:
                final = {"status": "expired", "expired_at": now}
            else:
                final = {
                    "status": "completed",
                    "finalizing_at": batch.get("finalizing_at") or now,
                    "completed_at": now,
                }
            done = await self.run_db(thd_finalize, {**batch, **final}, running.key, now)
            if done is None:
                running.finishing = False  # lines still run elsewhere (or were put back): the next round looks again
                return
            running.batch = done
            self._active.pop(running.id, None)
            counts = running.batch["request_counts"]
            log.info(
                "batch {batch} {status}: {completed} completed, {failed} failed of {total}",
                batch=running.id,
                status=running.batch["status"],
                **counts,
            )
        except BaseException:
            running.finishing = False
            raise

    async def _save(self, running: _Running) -> None:
        await self.run_db(store.thd_put_batch, running.id, strictjson.encode(running.batch))

    async def _expire_batch(self, running: _Running) -> None:
        running.expiring = running.exhausted = True
        failed = await self.run_db(store.thd_fail_pending, running.id, error_template(EXPIRED))
        counts = running.batch["request_counts"]
        running.batch["request_counts"] = {**counts, "failed": counts["failed"] + failed}
        await self._save(running)
        log.info("batch {batch} expired: {failed} lines never ran", batch=running.id, failed=failed)
        if running.in_flight == 0:
            self._finish_later(running)

    def _expire(self) -> None:
        """
        The periodic job: expire the batches past their C{expires_at}.
        """
        try:
            now = self.reactor.seconds()
            for running in list(self._active.values()):
                if (
                    running.batch["status"] == "in_progress"
                    and not running.expiring
                    and now >= running.batch["expires_at"]
                ):
                    Deferred.fromCoroutine(self._expire_batch(running)).addErrback(
                        lambda f: log.failure("expiring a batch failed", f)
                    )
        except Exception:
            log.failure("looking for expired batches failed")


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("retry-after")
    try:
        return max(0.1, min(float(value), 3600.0)) if value is not None else None
    except ValueError:
        return None


def _body_of(payload: bytes) -> object:
    """
    A response body for an output line: its JSON, else its text.
    """
    try:
        return json.loads(payload)
    except ValueError:
        return payload.decode("utf-8", "replace")


def _no_file(file_id: str, param: str | None = None) -> FileNotFound:
    shown = file_id if len(file_id) <= 100 else "(too long)"
    return FileNotFound(f"No such File object: {shown!r} (files belong to the API key that uploaded them)", param)


def _no_batch(batch_id: str) -> BatchNotFound:
    shown = batch_id if len(batch_id) <= 100 else "(too long)"
    return BatchNotFound(f"No such Batch object: {shown!r} (batches belong to the API key that made them)")


@implementer(IAgentEndpointFactory)
@attrs.frozen
class _UNIXEndpoints:
    reactor: Any
    path: str

    def endpointForURI(self, uri: Any) -> UNIXClientEndpoint:
        return UNIXClientEndpoint(self.reactor, self.path)


class LineSender:
    """
    Sends batch lines to the daemon's own Site over its private UNIX
    listener, with its own connection pool (closed by L{close}).
    """

    def __init__(self, reactor: Any, socket: Path, secret: str, pool_size: int = 8) -> None:
        """
        @param socket: The private listener's path.
        @param secret: The per-daemon secret it honours (never logged).
        """
        self._pool = HTTPConnectionPool(reactor, persistent=True)
        self._pool.maxPersistentPerHost = pool_size
        self._agent = Agent.usingEndpointFactory(reactor, _UNIXEndpoints(reactor, str(socket)), pool=self._pool)
        self._secret = secret.encode("ascii")

    async def send(self, key: str, endpoint: str, body: bytes, trace: str) -> tuple[int, Mapping[str, str], bytes]:
        """
        POST C{body} to C{endpoint} as key C{key}, at batch priority.

        @return: The status, the response headers (lower-cased names, last
            value) and the body.
        """
        headers = Headers(
            {
                b"content-type": [b"application/json"],
                b"x-blazar-priority": [PRIORITY],
                b"x-blazar-trace-id": [trace.encode("ascii")],
                SECRET_HEADER: [self._secret],
                KEY_HEADER: [key.encode("utf-8")],
            }
        )
        response = await self._agent.request(
            b"POST", b"http://blazar-batch" + endpoint.encode("ascii"), headers, FileBodyProducer(BytesIO(body))
        )
        payload = await readBody(response)
        found = {
            name.decode("latin-1").lower(): values[-1].decode("latin-1")
            for name, values in response.headers.getAllRawHeaders()
        }
        return int(response.code), found, bytes(payload)

    async def close(self) -> None:
        await self._pool.closeCachedConnections()
