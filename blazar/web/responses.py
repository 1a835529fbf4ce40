"""
The OpenAI Responses API (C{/v1/responses}), served by the OpenAI surface:
requests are translated (L{blazar.web.translate.responses}) into the same
chat request the other surfaces send, so keys, scopes, quotas, admission,
keep_alive, preflight, metrics and audit apply unchanged; stored responses
live in the data dir's SQLite (C{responses_ttl_secs}, C{responses_max_stored})
and are visible only to the API key that made them.

Source: OpenAI's API reference, "Responses" (create, retrieve, delete,
input items, input token counts, streaming events).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.web.iweb import IRequest

from blazar import store
from blazar.config import Config
from blazar.engines.llamacpp import EngineNotFound
from blazar.engines.supervisor import EngineError
from blazar.models.gguf_meta import GGUFError
from blazar.models.registry import ModelNotFound
from blazar.web.admission import WorkClass
from blazar.web.auth import key_of, record_usage
from blazar.web.ignored import note_ignored
from blazar.web.observe import note_error, note_tokens
from blazar.web.scope import redact
from blazar.web.proxy import KEEP_ALIVE_HEADER, EngineProxy, EngineRejected, keep_alive_of
from blazar.web.translate import responses as tr

log = Logger()

MAX_CHAIN = 100


class ResponseNotFound(Exception):
    """
    No stored response with that id for this key (404; never says whether
    another key has one).

    @ivar param: The request field that named it, or L{None}.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)


class Responses:
    """
    The Responses API's logic; the OpenAI surface routes to it.

    @param run_db: Runs a C{thd_*} function of L{blazar.store} with the
        database on the store's thread (L{None}: nothing is stored).
    """

    def __init__(
        self, proxy: EngineProxy, config: Callable[[], Config], clock: Any,
        run_db: Callable[..., Deferred[Any]] | None, wall: Callable[[], float] = time.time,
    ) -> None:
        self._proxy = proxy
        self._config = config
        self._clock = clock
        self._run_db = run_db
        self._wall = wall

    # -- storage ---------------------------------------------------------------

    def _key(self, request: IRequest) -> str:
        key = key_of(request)
        return key.name if key is not None else ""

    async def _load(self, request: IRequest, response_id: str, param: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]], str | None]:
        row = None
        if self._run_db is not None and isinstance(response_id, str):
            row = await self._run_db(store.thd_get_response, response_id, self._key(request), self._wall())
        if row is None:
            shown = response_id if isinstance(response_id, str) and len(response_id) <= 100 else "(too long)"
            raise ResponseNotFound(f"no response with id {shown!r} (responses are kept "
                                   f"responses_ttl_secs, for the API key that made them)", param)
        return json.loads(row[0]), json.loads(row[1]), row[2]

    async def _history(self, request: IRequest, previous: str) -> list[dict[str, Any]]:
        """
        The items of every turn before C{previous} (and its own), oldest first.
        """
        turns: list[list[dict[str, Any]]] = []
        current: str | None = previous
        while current is not None:
            if len(turns) >= MAX_CHAIN:
                raise tr.ResponsesRequestError(
                    f"previous_response_id: the conversation is longer than {MAX_CHAIN} turns; "
                    "start a new one", "previous_response_id",
                )
            response, inputs, earlier = await self._load(request, current, "previous_response_id")
            turns.append(inputs + tr.output_as_input(response.get("output") or []))
            current = earlier
        return [item for turn in reversed(turns) for item in turn]

    async def _store(self, request: IRequest, response: dict[str, Any], inputs: list[dict[str, Any]]) -> None:
        config = self._config()
        if self._run_db is None or config.responses_ttl <= 0 or not response.get("store"):
            return
        now = self._wall()
        items = [{"id": item.get("id") or tr.new_id("msg" if item.get("type", "message") == "message" else "item"),
                  **item} for item in inputs]
        row = (response["id"], self._key(request), now, now + config.responses_ttl,
               response.get("previous_response_id"), json.dumps(response), json.dumps(items))
        try:
            await self._run_db(store.thd_put_response, row, config.responses_max_stored)
        except Exception:
            log.failure("storing response {id} failed", id=response["id"])

    # -- routes ---------------------------------------------------------------

    async def _translate(
        self, request: IRequest, body: dict[str, Any]
    ) -> tuple[dict[str, Any], str | None, tr.ToolNames]:
        previous = body.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            raise tr.ResponsesRequestError("previous_response_id: must be a string", "previous_response_id")
        history = await self._history(request, previous) if previous else []
        ignored: list[str] = []
        names = tr.ToolNames()
        chat = tr.request_to_chat(body, history, ignored, names)
        note_ignored(request, "responses", ignored)
        return chat, previous, names

    async def create(self, request: IRequest, body: dict[str, Any]) -> bytes | None:
        """
        C{POST /v1/responses}: the response object, or its event stream.
        """
        chat, previous, names = await self._translate(request, body)
        model = body["model"]
        try:
            keep_alive = keep_alive_of(body, request.getHeader(KEEP_ALIVE_HEADER))
        except ValueError as e:
            raise tr.ResponsesRequestError(str(e), "keep_alive") from None
        canonical = await self._proxy.check_scope(request, model)
        await self._proxy.check_purpose(model, embedding=False)
        await self._proxy.place_system_messages(model, chat)
        raw = json.dumps(chat).encode("utf-8")  # once: its size bounds the prompt, then it is sent
        await self._proxy.preflight(
            model, chat.get("max_tokens"), len(raw), lambda: self._proxy.count_chat_tokens(model, chat),
        )
        await self._proxy.admit(request, canonical, WorkClass.TOOL if chat.get("tools") else WorkClass.INTERACTIVE)
        translator = tr.ResponsesStream(tr.response_object(body, model, int(self._wall()), previous), names)
        inputs = tr.input_items(body)
        if not body.get("stream"):
            instance, response = await self._proxy.send(model, "/v1/chat/completions", raw, request=request)
            def collect(chunk: dict[str, Any]) -> None:
                translator.feed(chunk)

            try:
                await self._proxy.relay_chunks(instance, response, collect, request)
            finally:
                instance.in_flight -= 1
                self._proxy.done(instance, keep_alive)
            translator.finish()
            self._usage(request, translator)
            await self._store(request, translator.response, inputs)
            request.setHeader(b"content-type", b"application/json")
            return tr.dump(translator.response)
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        self._write(request, translator.start())
        # the headers are out: from here on every failure ends the stream
        # with response.failed, never with an error body of its own
        try:
            instance, response = await self._proxy.send(model, "/v1/chat/completions", raw, request=request)
        except (EngineError, EngineRejected, EngineNotFound, GGUFError, ModelNotFound) as e:
            self._end_failed(request, translator, model, e)
            return None
        except CancelledError:
            raise
        except Exception:
            self._end_failed(request, translator, model, None)
            return None
        ended = False
        try:
            await self._proxy.relay_chunks(
                instance, response, lambda chunk: self._write(request, translator.feed(chunk)), request
            )
            self._write(request, translator.finish())
            ended = True
        except (EngineError, EngineRejected) as e:
            self._end_failed(request, translator, model, e)
            return None
        except CancelledError:
            raise
        except Exception:
            self._end_failed(request, translator, model, None, write=not ended)
            return None
        finally:
            instance.in_flight -= 1
            self._proxy.done(instance, keep_alive)
        self._usage(request, translator)
        await self._store(request, translator.response, inputs)
        return None

    def _end_failed(
        self, request: IRequest, translator: tr.ResponsesStream, model: str, error: Exception | None,
        write: bool = True,
    ) -> None:
        """
        End a stream whose headers are out with C{response.failed}: for a
        domain C{error} with its (redacted) message, else — called in the
        C{except} of a bug, which is logged with its traceback — with a
        pointer to the daemon's log.
        """
        if error is None:
            log.failure("responses stream for {model} broke", model=model)
            note_error(request, "5xx")
            message = "internal error; see the daemon log"
        else:
            log.error("responses stream for {model} failed: {error}", model=model, error=str(error))
            note_error(request, error if not isinstance(error, EngineRejected) else "engine_error")
            message = redact(request, str(error))
        if write:
            self._write(request, translator.fail(message))

    def _write(self, request: IRequest, events: list[tuple[str, dict[str, Any]]]) -> None:
        if events:
            request.write(b"".join(tr.sse(kind, payload) for kind, payload in events))

    def _usage(self, request: IRequest, translator: tr.ResponsesStream) -> None:
        usage = translator.response["usage"]
        note_tokens(request, usage["input_tokens"], usage["output_tokens"])
        record_usage(request, usage["input_tokens"] + usage["output_tokens"])

    async def input_tokens(self, request: IRequest, body: dict[str, Any]) -> bytes:
        """
        C{POST /v1/responses/input_tokens}: the prompt tokens a create with
        this body would report, counted by the child on the same rendering.
        """
        chat, _, _ = await self._translate(request, body)
        await self._proxy.check_scope(request, body["model"])
        await self._proxy.check_purpose(body["model"], embedding=False)
        await self._proxy.place_system_messages(body["model"], chat)
        count = await self._proxy.count_chat_tokens(body["model"], chat)
        request.setHeader(b"content-type", b"application/json")
        return json.dumps({"object": "response.input_tokens", "input_tokens": count}).encode("utf-8")

    async def retrieve(self, request: IRequest, response_id: str) -> bytes:
        response, _, _ = await self._load(request, response_id)
        request.setHeader(b"content-type", b"application/json")
        return tr.dump(response)

    async def items(self, request: IRequest, response_id: str) -> bytes:
        _, inputs, _ = await self._load(request, response_id)
        request.setHeader(b"content-type", b"application/json")
        return tr.dump({
            "object": "list", "data": inputs, "has_more": False,
            "first_id": inputs[0]["id"] if inputs else None, "last_id": inputs[-1]["id"] if inputs else None,
        })

    async def delete(self, request: IRequest, response_id: str) -> bytes:
        deleted = self._run_db is not None and await self._run_db(
            store.thd_delete_response, response_id, self._key(request)
        )
        if not deleted:
            raise ResponseNotFound(f"no response with id {response_id!r}")
        request.setHeader(b"content-type", b"application/json")
        return json.dumps({"id": response_id, "object": "response", "deleted": True}).encode("utf-8")
