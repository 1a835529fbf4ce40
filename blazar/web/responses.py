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

import attrs
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.web.iweb import IRequest

from blazar import store, strictjson
from blazar.config import Config
from blazar.gateway.admission import WorkClass
from blazar.gateway.call import Call, CallKind, max_tokens_of
from blazar.gateway.context import key_of
from blazar.gateway.errors import NotFound
from blazar.gateway.pipeline import Pipeline
from blazar.gateway.reply import Reply
from blazar.web.client import asked_of, context_of, judged, note_ignored, opened
from blazar.web.errors import in_stream
from blazar.web.sse import loading_comments
from blazar.web.translate import responses as tr
from blazar.web.translate.keep_alive import KEEP_ALIVE_HEADER, keep_alive_of

log = Logger()

MAX_CHAIN = 100


class ResponseNotFound(NotFound):
    """
    No stored response with that id for this key (404; never says whether
    another key has one). C{param} names the request field that named it.
    """


class Responses:
    """
    The Responses API's logic; the OpenAI surface routes to it.

    @param run_db: Runs a C{thd_*} function of L{blazar.store} with the
        database on the store's thread (L{None}: nothing is stored).
    """

    def __init__(
        self,
        pipeline: Pipeline,
        config: Callable[[], Config],
        clock: Any,
        run_db: Callable[..., Deferred[Any]] | None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._pipeline = pipeline
        self._config = config
        self._clock = clock
        self._run_db = run_db
        self._wall = wall

    # -- storage ---------------------------------------------------------------

    def _key(self, request: IRequest) -> str:
        key = key_of(context_of(request))
        return key.owner if key is not None else ""

    async def _load(
        self, request: IRequest, response_id: str, param: str | None = None
    ) -> tuple[dict[str, Any], list[dict[str, Any]], str | None]:
        row = None
        text = isinstance(response_id, str) and response_id.encode("utf-8", "replace").decode("utf-8") == response_id
        if self._run_db is not None and text:  # (a lone surrogate is no id, and SQLite cannot take it)
            row = await self._run_db(store.thd_get_response, response_id, self._key(request), self._wall())
        if row is None:
            shown = (response_id if len(response_id) <= 100 else "(too long)") if text else "(not a valid id)"
            raise ResponseNotFound(
                f"no response with id {shown!r} (responses are kept "
                f"responses_ttl_secs, for the API key that made them)",
                param,
            )
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
                    f"previous_response_id: the conversation is longer than {MAX_CHAIN} turns; start a new one",
                    "previous_response_id",
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
        items = [
            {"id": item.get("id") or tr.new_id("msg" if item.get("type", "message") == "message" else "item"), **item}
            for item in inputs
        ]
        row = (
            response["id"],
            self._key(request),
            now,
            now + config.responses_ttl,
            response.get("previous_response_id"),
            strictjson.encode(response),
            strictjson.encode(items),
        )
        try:
            await self._run_db(store.thd_put_response, row, config.responses_max_stored)
        except store.StoreUnavailable:
            raise  # (the client asked for store: true: an answer it could not continue is not a success)
        except Exception:
            log.failure("storing response {id} failed", id=response["id"])

    # -- routes ---------------------------------------------------------------

    async def _translate(self, request: IRequest, body: dict[str, Any]) -> tuple[Call, str | None, tr.ToolNames]:
        previous = body.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            raise tr.ResponsesRequestError("previous_response_id: must be a string", "previous_response_id")
        history = await self._history(request, previous) if previous else []
        ignored: list[str] = []
        names = tr.ToolNames()
        chat = tr.request_to_chat(body, history, ignored, names)
        note_ignored(request, "responses", ignored)
        try:
            keep_alive = keep_alive_of(body, request.getHeader(KEEP_ALIVE_HEADER))
        except ValueError as e:
            raise tr.ResponsesRequestError(str(e), "keep_alive") from None
        call = Call(
            "responses",
            CallKind.CHAT,
            body["model"],
            "/v1/chat/completions",
            chat,
            stream=True,
            keep_alive=keep_alive,
            max_tokens=max_tokens_of(chat),
            names=("max_output_tokens", "input"),
            work=WorkClass.TOOL if chat.get("tools") else WorkClass.INTERACTIVE,
            asked=asked_of(
                request, body.get("prompt_cache_key") if isinstance(body.get("prompt_cache_key"), str) else None
            ),
        )
        return call, previous, names

    async def create(self, request: IRequest, body: dict[str, Any]) -> bytes | None:
        """
        C{POST /v1/responses}: the response object, or its event stream.
        """
        call, previous, names = await self._translate(request, body)
        model = call.model
        translator = tr.ResponsesStream(tr.response_object(body, model, int(self._wall()), previous), names)
        inputs = tr.input_items(body)
        if not body.get("stream"):
            call = attrs.evolve(
                call, client_stream=False
            )  # the engine's stream makes one response (the cache may answer)
            async with opened(self._pipeline, request, call) as reply:
                await judged(request, reply, reply.chunks(translator.feed))
            translator.finish()
            self._usage(reply, translator)
            await self._store(request, translator.response, inputs)
            request.setHeader(b"content-type", b"application/json")
            return tr.dump(translator.response)

        headers_out = False

        def on_send(cold: bool) -> Callable[[], None] | None:
            nonlocal headers_out
            headers_out = True
            request.setHeader(b"content-type", b"text/event-stream")
            request.setHeader(b"cache-control", b"no-cache")
            self._write(request, translator.start())
            # a model load first: comments until it answers, as on the OpenAI surface
            return loading_comments(request.write, self._clock) if cold else None

        # once the headers are out, every failure ends the stream with
        # response.failed, never with an error body of its own
        call = attrs.evolve(call, on_send=on_send)
        ended = False
        terminal: list[tuple[str, dict[str, Any]]] = []
        try:
            async with opened(self._pipeline, request, call) as reply:
                await judged(request, reply, reply.chunks(lambda chunk: self._write(request, translator.feed(chunk))))
                events = translator.finish()
                # the terminal event (response.completed) waits for the store: a response the
                # client asked to store and that could not be is response.failed instead
                self._write(request, events[:-1])
                terminal = events[-1:]
                ended = True
        except Exception as e:
            problem = in_stream(request, e, model, "responses", headers_out)
            self._write(request, terminal if ended else translator.fail(problem.message))
            return None
        self._usage(reply, translator)
        try:
            await self._store(request, translator.response, inputs)
        except store.StoreUnavailable as e:
            log.error("response {id} not stored: {why}", id=translator.response["id"], why=str(e))
            self._write(request, translator.fail(f"the response was not stored: {e}", "store_unavailable"))
            return None
        self._write(request, terminal)
        return None

    def _write(self, request: IRequest, events: list[tuple[str, dict[str, Any]]]) -> None:
        if events:
            request.write(b"".join(tr.sse(kind, payload) for kind, payload in events))

    def _usage(self, reply: Reply, translator: tr.ResponsesStream) -> None:
        usage = translator.response["usage"]
        reply.usage(usage["input_tokens"], usage["output_tokens"])

    async def input_tokens(self, request: IRequest, body: dict[str, Any]) -> bytes:
        """
        C{POST /v1/responses/input_tokens}: the prompt tokens a create with
        this body would report, counted by the child on the same rendering.
        """
        call, _, _ = await self._translate(request, body)
        count = await self._pipeline.count(context_of(request), call)
        request.setHeader(b"content-type", b"application/json")
        return strictjson.encode({"object": "response.input_tokens", "input_tokens": count}).encode("utf-8")

    async def retrieve(self, request: IRequest, response_id: str) -> bytes:
        response, _, _ = await self._load(request, response_id)
        request.setHeader(b"content-type", b"application/json")
        return tr.dump(response)

    async def items(self, request: IRequest, response_id: str) -> bytes:
        _, inputs, _ = await self._load(request, response_id)
        request.setHeader(b"content-type", b"application/json")
        return tr.dump(
            {
                "object": "list",
                "data": inputs,
                "has_more": False,
                "first_id": inputs[0]["id"] if inputs else None,
                "last_id": inputs[-1]["id"] if inputs else None,
            }
        )

    async def delete(self, request: IRequest, response_id: str) -> bytes:
        deleted = self._run_db is not None and await self._run_db(
            store.thd_delete_response, response_id, self._key(request)
        )
        if not deleted:
            raise ResponseNotFound(f"no response with id {response_id!r}")
        request.setHeader(b"content-type", b"application/json")
        return strictjson.encode({"id": response_id, "object": "response", "deleted": True}).encode("utf-8")
