"""
Calling engine children for the pipeline (L{blazar.gateway.pipeline}):
pick a ready child, send the body, read or relay what comes back, and turn
every way that can fail into a domain error (L{blazar.gateway.errors}).
Also the pipeline's engine-side checks: the context preflight and the
chat template's system-message probe.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable
from weakref import WeakKeyDictionary

from twisted.internet.defer import (
    CancelledError,
    Deferred,
    DeferredSemaphore,
    ensureDeferred,
)
from twisted.internet.defer import (
    TimeoutError as DeferredTimeout,
)
from twisted.internet.error import ConnectingCancelledError
from twisted.logger import Logger
from twisted.python.failure import Failure

from blazar import strictjson
from blazar.config import Config
from blazar.engines.client import IEngineClient, NotDelivered, StaleConnection
from blazar.engines.errors import EngineError, EngineTimeout
from blazar.engines.instance import IInstance, InstanceState
from blazar.engines.interfaces import ISupervisor
from blazar.engines.lanes import LLAMACPP, SDCPP
from blazar.engines.lease import InstanceLease
from blazar.engines.llamacpp import context_per_slot
from blazar.engines.remote import is_remote, scrub
from blazar.engines.sse import SSEEvents
from blazar.gateway import placement
from blazar.gateway.backpressure import ClientPacer
from blazar.gateway.context import RequestContext, note_span, timing_of
from blazar.gateway.errors import EngineRejected, PromptTooLong
from blazar.httpbody import BodyStalled, BodyTooLarge, BodyValve, read_body, relay_body
from blazar.models.registry import ModelEntry, ModelRegistry

log = Logger()

STREAM_IDLE_TIMEOUT = 600.0
# llama-server answers 500 for these, but the request is at fault
CLIENT_FAULTS = (
    "Failed to parse",
    "is not supported",
    "not supported by",
    "too large to process",
    "exceeds the available context",
    "exceed_context_size",
    "Invalid ",
)
MAX_ENGINE_BODY = 256 * 1024 * 1024
MAX_ERROR_BODY = 1 << 20
# how long a llama.cpp child has, after a client left, to report the task it
# stopped (its tokens are then counted against the client's key)
CANCEL_REPORT_SECS = 10.0
# the context preflight's token counts, before admission: at most this many
# per model at once, each done (its wait for a turn included) within the time
COUNTS_PER_MODEL = 2
COUNT_DEADLINE_SECS = 10.0


class StreamStopped(Exception):
    """
    Raised by a relay callback to stop reading a child's stream on purpose
    (e.g. a stop sequence matched); closing the connection stops the child.
    """


# Bytes of template text a chat template may add around the messages (role
# markers, default system prompts, tool instructions): below this margin a
# body cannot overflow the context, whatever it holds, so nothing is counted.
TEMPLATE_SLACK = 1024


class _Retry(Exception):
    """
    Internal: send the request again, on a fresh child.
    """


class ChildWedged(Exception):
    """
    A child took a request and neither answers it nor its /health.
    """


_TICK = object()


def was_cancelled(error: BaseException) -> bool:
    """
    Whether C{error} is, or wraps, a cancellation (a client that left):
    Twisted's HTTP client reports a cancelled request as
    C{ResponseNeverReceived([CancelledError])}.
    """
    if isinstance(error, (CancelledError, ConnectingCancelledError)):
        return True
    reasons = getattr(error, "reasons", None) or []
    return any(r.check(CancelledError, ConnectingCancelledError) for r in reasons)


def engine_error_message(body: bytes) -> str:
    """
    The human message in an engine's error body (llama-server answers
    C{{"error": {"code", "message", "type"}}}), or the raw text.
    """
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:2000]
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"][:2000]
        if isinstance(error, str):
            return error[:2000]
    return body.decode("utf-8", "replace")[:2000]


def stream_error_message(error: Any) -> str:
    """
    The message of an C{error} value an engine put in a stream chunk.
    """
    if isinstance(error, dict):
        return str(error.get("message", error))[:2000]
    return str(error)[:2000]


def note_load(context: RequestContext | None, instance: Any, began: float, now: float) -> None:
    """
    A C{load} span in the request's trace if C{instance} became ready while
    the request waited for it (from C{began} to C{now}, clock seconds).
    """
    ready_at = getattr(instance, "ready_at", None)
    if ready_at is not None and ready_at >= began:
        note_span(context, "load", began, now)


class EngineProxy:
    """
    The pipeline's way to talk to engine children.
    """

    def __init__(
        self,
        supervisor: ISupervisor,
        engines: IEngineClient,
        clock: Any,
        registry: ModelRegistry | None = None,
        config: Callable[[], Config] = Config,
    ) -> None:
        """
        @param config: The live config (L{blazar.config.LiveConfig}):
            C{child_header_timeout_secs} is read per engine request and
            C{stream_stall_close_secs} per stream, so a reload applies to the
            next ones.
        """
        self._config = config
        self.supervisor = supervisor
        self._registry = registry
        self._engines = engines
        self._clock = clock
        # child -> whether its chat template takes a system message after
        # the first turn (asked once per child); model -> requests waiting
        # for the probe under way
        self._mid_system: WeakKeyDictionary[Any, bool] = WeakKeyDictionary()
        self._probing: dict[str, list[Deferred[bool]]] = {}
        self._counts: dict[str, DeferredSemaphore] = {}  # model -> its preflight counts (L{_bounded_count})

    async def preflight(
        self,
        model: str,
        max_tokens: int | None,
        body_size: int,
        count: Callable[[], Awaitable[int]],
        ctx_size: int | None = None,
        entry: ModelEntry | None = None,
        names: tuple[str, str] = ("max_tokens", "messages"),
        floor: int = 0,
    ) -> int | None:
        """
        Refuse a request whose prompt plus C{max_tokens} exceeds the
        model's per-slot context, instead of letting the engine cut the
        answer short. Tokens are counted (by C{count}, with the child's own
        tokenizer) only when the body is large enough to matter: a prompt
        has at most as many tokens as its rendering has bytes.

        @param ctx_size: The context per slot the request asks for
            (Ollama's C{num_ctx}); it is checked against the context the
            supervisor plans for it (L{Supervisor.context_for}: grown
            under C{ctx_policy = "grow"}, within the trained context and
            free memory), and the levers say what held that below it.
        @param entry: The model, if the caller resolved it already.
        @param names: What the client's API calls the output limit and the
            prompt (C{max_output_tokens} and C{input} on the Responses API,
            C{num_predict} on Ollama's), for the message and C{param}.
        @param floor: Tokens the prompt has at least, known without
            counting (its text's size over the vocabulary's longest
            token): a prompt that cannot fit by it is refused uncounted.
        @return: The prompt's token count if it had to be counted.
        @raise PromptTooLong: With both numbers and the levers.
        @raise EngineRejected: A 503: the count took over
            L{COUNT_DEADLINE_SECS} (at most L{COUNTS_PER_MODEL} run at once
            per model; the rest wait their turn within the same time).
        """
        if self._registry is None or (max_tokens is None and not floor):
            return None
        if entry is None:
            entry = await self._registry.resolve(model)
        limit, prompt_field = names
        loaded = self.supervisor.loaded(entry.name)
        levers = f'shorten the prompt, lower {limit}, or raise ctx_size under [models."{entry.name}"]'
        if ctx_size is not None:
            plan = await self.supervisor.context_for(entry.name, ctx_size)
            ctx = plan.ctx
            if plan.shortfall():
                levers = f"shorten the prompt or lower {limit} ({plan.shortfall()})"
        elif loaded is not None and loaded.ctx:
            ctx = loaded.ctx  # the usual case: no GGUF stat on the request path
        else:
            ctx = context_per_slot(entry, await self._registry.metadata(entry))
        if max_tokens is None:
            # no output limit: the prompt alone must fit (llama-server counts it, unless its size says)
            if floor > ctx:
                raise PromptTooLong(
                    f"the prompt is at least {floor} tokens (by its size): over the {ctx}-token context of "
                    f"{entry.name!r} (per slot): {levers}",
                    prompt_field,
                )
            return None
        if max_tokens >= ctx:
            raise PromptTooLong(
                f"{limit} = {max_tokens} does not fit in the {ctx}-token context of "
                f"{entry.name!r} (per slot), which also holds the prompt: {levers}",
                limit,
            )
        if body_size + TEMPLATE_SLACK + max_tokens <= ctx:
            return None
        if floor + max_tokens > ctx:
            raise PromptTooLong(
                f"the prompt is at least {floor} tokens (by its size) and {limit} is {max_tokens}: over the "
                f"{ctx}-token context of {entry.name!r} (per slot): {levers}",
                prompt_field,
            )
        prompt = await self._bounded_count(entry.name, count)
        if prompt + max_tokens > ctx:
            raise PromptTooLong(
                f"the prompt is {prompt} tokens and {limit} is {max_tokens}: {prompt + max_tokens} "
                f"tokens exceed the {ctx}-token context of {entry.name!r} (per slot): {levers}",
                prompt_field,
            )
        return prompt

    async def _bounded_count(self, model: str, count: Callable[[], Awaitable[int]]) -> int:
        """
        C{count()} once fewer than L{COUNTS_PER_MODEL} counts run for
        C{model}, all within L{COUNT_DEADLINE_SECS}: the context preflight
        runs before admission, so without a bound any number of large
        prompts could keep a child rendering and tokenizing.
        """
        gate = self._counts.get(model)
        if gate is None:
            gate = self._counts[model] = DeferredSemaphore(COUNTS_PER_MODEL)

        async def counted() -> int:
            return await count()

        work: Deferred[int] = gate.run(counted)
        work.addTimeout(COUNT_DEADLINE_SECS, self._clock)
        try:
            return await work
        except DeferredTimeout:
            raise EngineRejected(
                503,
                f"counting the prompt's tokens for {model!r} took over {COUNT_DEADLINE_SECS:g} s (the "
                f"model's child is busy counting other large prompts); send it again shortly, or a shorter prompt",
                retry_after=5.0,
            ) from None
        finally:
            if not gate.waiting and gate.tokens == gate.limit:
                self._counts.pop(model, None)

    async def place_system_messages(self, model: str, chat_body: dict[str, Any]) -> bool:
        """
        Render the system and developer messages of an OpenAI chat body in
        place, the way the model's chat template takes them
        (L{blazar.gateway.placement}); changes C{chat_body["messages"]}.

        @return: Whether the messages changed (a raw body must be encoded again).
        """
        messages = chat_body.get("messages")
        if not placement.needs_placement(messages):
            return False
        assert isinstance(messages, list)
        ok = await self.mid_system_ok(model)
        chat_body["messages"] = placement.place(messages, ok)
        return True

    async def mid_system_ok(self, model: str) -> bool:
        """
        Whether C{model}'s chat template renders a system message after the
        first turn in its place: asked once per child (the template is the
        running child's, whatever file is on disk now), by rendering
        L{placement.PROBE} with its C{/apply-template}; concurrent first
        requests share one probe. A template that raises or drops it
        answers L{False}.

        @raise blazar.engines.supervisor.EngineError: No child could be
            started to ask.
        """
        name = (await self._registry.resolve(model)).name if self._registry is not None else model
        loaded = self.supervisor.loaded(name)
        if loaded is not None and loaded in self._mid_system:
            return self._mid_system[loaded]
        waiters = self._probing.get(name)
        if waiters is None:
            waiters = self._probing[name] = []
            # not tied to the request: a client that leaves does not stop
            # the probe the others wait for
            ensureDeferred(self._probe_template(model, name)).addErrback(
                lambda f: log.failure("probing {model}'s chat template failed", f, model=name)
            )
        waiter: Deferred[bool] = Deferred()
        waiters.append(waiter)
        return await waiter

    async def _probe_template(self, model: str, name: str) -> None:
        outcome: Any
        try:
            try:
                lease, response = await self.send(
                    model, "/apply-template", strictjson.encode(placement.PROBE).encode("utf-8"), stream=False
                )
                instance = lease.instance
            except EngineRejected as e:
                log.info(
                    "{model}: its chat template refuses a system message after the first turn "
                    "({error}); such messages are rendered as <system-reminder> blocks",
                    model=name,
                    error=str(e)[:200],
                )
                ok, child = False, self.supervisor.loaded(name)
            else:
                try:
                    payload = await self.read(instance, response)
                finally:
                    lease.release()
                try:
                    ok = placement.probe_accepts(json.loads(payload).get("prompt"))
                except (ValueError, AttributeError):
                    ok = False
                if not ok:
                    log.info(
                        "{model}: its chat template drops a system message after the first turn; "
                        "such messages are rendered as <system-reminder> blocks",
                        model=name,
                    )
                child = instance
            if child is not None:
                self._mid_system[child] = ok
            outcome = ok
        except BaseException:
            outcome = Failure()
        for waiter in self._probing.pop(name, []):
            if not waiter.called:  # (a waiter whose client left was cancelled)
                if isinstance(outcome, Failure):
                    waiter.errback(outcome)
                else:
                    waiter.callback(outcome)

    async def count_chat_tokens(self, model: str, chat_body: dict[str, Any]) -> int:
        """
        Prompt tokens of an OpenAI chat body, rendered by the child's chat
        template and counted by its tokenizer (the number a real request
        reports as C{usage.prompt_tokens}).
        """
        body = {k: v for k, v in chat_body.items() if k not in ("stream", "stream_options")}
        lease, response = await self.send(
            model, "/v1/chat/completions/input_tokens", strictjson.encode(body).encode("utf-8"), stream=False
        )
        try:
            return int(json.loads(await self.read(lease.instance, response))["input_tokens"])
        finally:
            lease.release()

    async def count_text_tokens(self, model: str, text: str, add_special: bool = True) -> int:
        """
        Tokens of raw text (a completion prompt, with its BOS; or, without
        C{add_special}, text a model wrote), by the child's tokenizer.
        """
        body = {"content": text, "add_special": add_special}
        lease, response = await self.send(model, "/tokenize", strictjson.encode(body).encode("utf-8"), stream=False)
        try:
            return len(json.loads(await self.read(lease.instance, response))["tokens"])
        finally:
            lease.release()

    async def token_pieces(self, model: str, prompt: Any) -> list[Any]:
        """
        A prompt's tokens and their text, by the child's tokenizer
        (C{/tokenize} with C{with_pieces}; no BOS: only the prompt's own).
        """
        body = {"content": prompt, "add_special": False, "with_pieces": True}
        lease, response = await self.send(
            model,
            "/tokenize",
            strictjson.encode(body).encode("utf-8"),
            stream=False,
        )
        try:
            tokens = json.loads(await self.read(lease.instance, response)).get("tokens")
        finally:
            lease.release()
        return tokens if isinstance(tokens, list) else []

    async def answer_tokens(self, instance: IInstance, text: str) -> list[int]:
        """
        The tokens the child C{instance} gives C{text} (C{/tokenize}, no
        BOS): an answer it wrote, for the model's lookup cache
        (L{blazar.engines.lookupcache}). Only that child is asked, never a
        fresh one started for it: C{[]} when it is being stopped or gone.
        """
        if _stopping(instance) or self.supervisor.exited(instance):
            return []
        headers = dict(instance.auth_headers)
        headers[b"content-type"] = [b"application/json"]
        body = strictjson.encode({"content": text, "add_special": False}).encode("utf-8")
        lease = InstanceLease(self.supervisor, instance)  # busy meanwhile: not evicted under it
        try:
            response = await self._engines.request("POST", instance.base_url + "/tokenize", body, headers, False)
            data = await self.read(instance, response)
        finally:
            lease.release()
        if response.code != 200:
            return []
        tokens = json.loads(data).get("tokens")
        return [t for t in tokens if isinstance(t, int)] if isinstance(tokens, list) else []

    async def send(
        self,
        model: str,
        path: str,
        body: bytes,
        ctx_size: int | None = None,
        context: RequestContext | None = None,
        stream: bool = True,
        ready: tuple[IInstance, float] | None = None,
        content_type: str = "application/json",
    ) -> tuple[InstanceLease, Any]:
        """
        Send C{body} to a ready child for C{model}; return the lease on the
        child (the caller ends it) and its 200 response (headers read, body
        not yet).

        A request the child cannot have taken (the connection refused,
        reset or closed before the request was written:
        L{blazar.engines.client.NotDelivered}) because the child had
        exited, whether or not its exit was reported yet, goes once to a
        fresh child instead of failing. A request the child may have read
        (a clean close before any answer, any byte of an answer) fails:
        running it again could run it twice.

        @param context: The request this is for (its trace gets C{load}
            and C{generate} spans).
        @param stream: Whether the child streams its answer (L{False}: a
            reply read whole, sent over a kept-alive connection).
        @param ready: The child the caller already waited for, and when it
            began waiting (clock seconds): the first attempt goes to it.
        @raise blazar.models.registry.ModelNotFound: No such model.
        @raise blazar.engines.supervisor.EngineError: The child could not
            be started or reached.
        @raise EngineRejected: The child answered an error status.
        """
        for attempt in (1, 2):
            if attempt == 1 and ready is not None and not _stopping(ready[0]):
                instance, began = ready
            else:
                # (or the child it waited for is being stopped, by an
                # unload or an eviction since: the next one serves it)
                began = self._clock.seconds()
                instance = await self.supervisor.instance_for(model, ctx_size)
            if context is not None:
                now = self._clock.seconds()
                note_load(context, instance, began, now)
                note_span(context, "generate", now)
            # busy from now on: idle eviction and keep_alive 0 of other
            # requests wait for this one (the caller ends the lease)
            lease = InstanceLease(self.supervisor, instance)
            try:
                return lease, await self._send_to(instance, model, path, body, attempt, stream, content_type)
            except _Retry:
                lease.release()
                continue
            except CancelledError:
                lease.release()
                self.count_abandoned(context, instance)
                raise
            except BaseException:
                lease.release()
                raise
        raise AssertionError("unreachable")

    async def _send_to(
        self,
        instance: IInstance,
        model: str,
        path: str,
        body: bytes,
        attempt: int,
        stream: bool = True,
        content_type: str = "application/json",
    ) -> Any:
        """
        One attempt of L{send}; raises L{_Retry} when a fresh child should
        get the request.
        """
        headers = dict(instance.auth_headers)
        headers[b"content-type"] = [content_type.encode("ascii")]
        url = instance.base_url + path
        try:
            try:
                response = await self._headers(
                    instance, ensureDeferred(self._engines.request("POST", url, body, headers, stream))
                )
            except (NotDelivered, StaleConnection) as failed:
                if self.supervisor.exited(instance):
                    if isinstance(failed, NotDelivered):
                        raise  # it never reached the child: a fresh child, below
                    raise failed.error from None  # it may have read it, then died: a crash
                # the child is alive and closed the connection as it was
                # reused (an idle one, or on its way out) without reading
                # this request; once more on a fresh connection
                response = await self._headers(
                    instance, ensureDeferred(self._engines.request("POST", url, body, headers, True))
                )
        except EngineError:
            raise  # a remote's timeout (L{_headers}): already the answer
        except ChildWedged:
            self.supervisor.kill_instance(instance, "wedged: no response headers")
            if attempt == 2:
                raise _wedged(self._config(), instance, "accepted the request but sent nothing", ", twice") from None
            log.warn("{model} is wedged; retrying on a fresh child", model=model)
            raise _Retry()
        except Exception as e:
            if was_cancelled(e):
                raise CancelledError() from None
            undelivered = isinstance(e, NotDelivered) and attempt == 1
            if undelivered and self.supervisor.exited(instance):
                log.info("{model} had exited; sending the request to a fresh child", model=model)
                raise _Retry()
            error = await self.supervisor.explain_failure(instance, e)
            if undelivered and instance.state == InstanceState.DEAD:  # its exit was reported meanwhile
                log.info("{model} had exited; sending the request to a fresh child", model=model)
                raise _Retry()
            raise error from None
        if response.code != 200:
            try:
                error_body = await read_body(
                    response,
                    self._clock,
                    idle_timeout=STREAM_IDLE_TIMEOUT,
                    max_bytes=MAX_ERROR_BODY,
                )
                message = engine_error_message(error_body)
            except BodyTooLarge:
                message = "the engine's error message is over 1 MiB (not shown); the request is likely malformed"
                if response.code == 500:
                    raise EngineRejected(400, message) from None
            status = response.code
            if is_remote(instance):
                raise self._remote_rejected(instance, status, message, _retry_after(response))
            if status == 500 and any(m in message for m in CLIENT_FAULTS):
                status = 400
            raise EngineRejected(status, message)
        if is_remote(instance):
            self.supervisor.remote_ok(instance)
        return response

    def _remote_rejected(
        self, instance: Any, status: int, message: str, retry_after: float | None = None
    ) -> EngineRejected:
        """
        A remote's error answer, as the client's: its 5xx counts for its
        breaker and is a 502; a refused key is Blazar's config to fix (a
        502 naming it), not the client's 401; its 4xx (a bad request, an
        unknown model, its own rate limit) stays what it is.
        """
        remote = instance.remote
        message = scrub(message, remote, instance.environ)
        if status == 500 and any(m in message for m in CLIENT_FAULTS):
            return EngineRejected(400, f"{instance.server}: {message}")  # the request's fault (llama-server's words)
        if status >= 500:
            if status in (502, 503, 504):  # it (or what is behind it) is down: for everyone, so its breaker
                self.supervisor.remote_failed(instance, f"status {status}: {message}")
            # (another 5xx may be one request's doing: a client must not open the breaker for all)
            return EngineRejected(502, f"{instance.server} answered {status}: {message}")
        if status in (401, 403):
            return EngineRejected(
                502,
                f"{instance.server} refused Blazar's credentials ({status}: {message}); "
                f"set api_key or api_key_env of [[remotes]] name = {remote.name!r}",
            )
        return EngineRejected(status, f"{instance.server}: {message}", retry_after if status == 429 else None)

    async def _headers(self, instance: IInstance, request: Deferred[Any]) -> Any:
        """
        Wait for the child's response headers. Every
        C{child_header_timeout_secs} without them, ask the child's
        C{/health}: a child that still answers is busy (a long non-streamed
        generation) and is waited for; one that does not is wedged.

        @raise ChildWedged: The child is wedged (the request is cancelled).
        """
        cancelled = False

        def cancel(_: Deferred[Any]) -> None:
            # the client left: whatever the engine request fails with now
            # (ConnectingCancelledError, DNSLookupError mid-connect, ...)
            # is the cancellation, not an engine failure
            nonlocal cancelled
            cancelled = True
            request.cancel()

        outcome: Deferred[Any] = Deferred(cancel)

        def settle(result: Any) -> None:
            if not cancelled and not outcome.called:
                outcome.callback(result)

        request.addBoth(settle)
        while True:
            timer = self._clock.callLater(header_timeout_of(self._config(), instance)[1], settle, _TICK)
            try:
                result = await outcome  # a failed request raises here
            finally:
                if timer.active():
                    timer.cancel()
            if result is not _TICK:
                return result
            if is_remote(instance):
                cancelled = True  # so settle ignores the cancellation
                request.cancel()
                error = self.supervisor.remote_failed(instance, "no response headers within timeout_secs")
                raise EngineTimeout(
                    instance.entry.name,
                    f"{instance.server} for model {instance.entry.name!r}: "
                    f"{error} = {instance.remote.timeout:g} s ([[remotes]] timeout_secs)",
                )
            outcome = Deferred(cancel)
            try:
                healthy = await self.supervisor.probe_health(instance)
            except CancelledError:
                cancelled = True
                request.cancel()
                raise
            except Exception:
                healthy = False
            if not healthy:
                cancelled = True  # so settle ignores the cancellation
                request.cancel()
                raise ChildWedged()

    async def read(self, instance: IInstance, response: Any) -> bytes:
        """
        The whole body of a child's response.

        @raise blazar.engines.supervisor.EngineError: The child died or
            stalled before it finished.
        """
        try:
            return await read_body(
                response,
                self._clock,
                idle_timeout=STREAM_IDLE_TIMEOUT,
                max_bytes=MAX_ENGINE_BODY,
                close_ends=is_remote(instance),
            )
        except Exception as e:
            if was_cancelled(e):
                raise CancelledError() from None
            raise await self.supervisor.explain_failure(instance, e) from None

    async def relay_chunks(
        self,
        instance: IInstance,
        response: Any,
        on_chunk: Callable[[dict[str, Any]], Any],
        context: RequestContext | None = None,
    ) -> None:
        """
        Feed each JSON chunk of a child's SSE stream to C{on_chunk} (for
        surfaces that translate); C{[DONE]} is dropped and an in-stream
        C{error} raises L{EngineRejected}.
        """

        def on_event(data: bytes) -> None:
            if data == b"[DONE]":
                return
            chunk = strictjson.parse(data)  # (orjson where it reads as json does)
            if "error" in chunk:
                message = stream_error_message(chunk["error"])
                if is_remote(instance):
                    raise EngineRejected(
                        502, f"{instance.server}'s stream failed: {scrub(message, instance.remote, instance.environ)}"
                    )
                raise EngineRejected(500, message)
            on_chunk(chunk)

        await self.relay(instance, response, SSEEvents(on_event).feed, context)

    async def relay(
        self,
        instance: IInstance,
        response: Any,
        on_chunk: Callable[[bytes], None],
        context: RequestContext | None = None,
    ) -> None:
        """
        Feed the child's body to C{on_chunk} as it arrives; with C{context},
        note when bytes arrived on it (L{blazar.gateway.context.StreamTiming},
        for time to first token and time per output token).

        With a client on a live HTTP channel (its
        L{blazar.gateway.context.IClient.consumer}), the relay is the response's
        producer (L{ClientPacer}): while the client does not read, the
        child's connection is not read either, and a client paused for
        C{stream_stall_close_secs} is disconnected. It returns once the
        client has taken what was written.

        @raise blazar.engines.supervisor.EngineError: The child died or
            stalled mid-way.
        @raise EngineRejected: C{on_chunk} raised it, or could not parse
            the stream (C{ValueError}).
        @raise CancelledError: The client left (or was cut off as stalled).
        """
        timing = timing_of(context)
        if timing is not None:
            tick, seconds, feed = timing.tick, self._clock.seconds, on_chunk

            def on_chunk(data: bytes) -> None:
                tick(seconds(), data.count(b"\n\n") or 1)
                feed(data)

        valve, pacer = BodyValve(), None
        consumer = context.client.consumer() if context is not None and context.client is not None else None
        if consumer is not None:
            pacer = ClientPacer(
                consumer, valve, self._clock, self._config().stream_stall_close, instance.entry.name, context
            )
            if not pacer.register():
                pacer = None
        quiet = None
        if not is_remote(instance) and getattr(instance, "protocol", None) is not None:
            # silent for as long as headers may take: is the child still there? (a child
            # SIGSTOPped mid-stream held the stream for STREAM_IDLE_TIMEOUT)
            quiet = (
                header_timeout_of(self._config(), instance)[1],
                lambda: ensureDeferred(self.supervisor.probe_health(instance)),
            )
        try:
            reading = relay_body(
                response,
                on_chunk,
                self._clock,
                idle_timeout=STREAM_IDLE_TIMEOUT,
                valve=valve,
                close_ends=is_remote(instance),
                quiet=quiet,
            )
            if pacer is not None:
                pacer.follow(reading)
            await reading
            if pacer is not None:
                await pacer.drained()
        except CancelledError:
            self.count_abandoned(context, instance)
            raise
        except (EngineRejected, StreamStopped):
            raise
        except ValueError as e:
            # on_chunk could not parse what the engine sent
            raise EngineRejected(502, f"engine sent a malformed stream: {e}") from None
        except Exception as e:
            if was_cancelled(e):
                raise CancelledError() from None
            if isinstance(e, BodyStalled):
                self.supervisor.kill_instance(instance, "wedged: silent mid-answer, no /health")
                raise _wedged(self._config(), instance, "stopped sending its answer") from None
            raise await self.supervisor.explain_failure(instance, e) from None
        finally:
            if pacer is not None:
                pacer.unregister()

    def count_abandoned(self, context: RequestContext | None, instance: Any) -> None:
        """
        The client of the request left while a llama.cpp child worked on it,
        before the answer's usage was counted: what the child reports for
        the task it stopped (the prompt and the tokens generated until the
        stop, L{blazar.engines.process.EngineProcessProtocol.next_cancelled})
        is counted against the key's token limits (C{tpm},
        C{daily_tokens}). A task the child finished, or never started,
        reports nothing within L{CANCEL_REPORT_SECS}, and nothing is counted.
        """
        record = context.usage if context is not None else None
        protocol = getattr(instance, "protocol", None)
        if record is None or protocol is None or is_remote(instance):
            return
        if getattr(instance, "lane", LLAMACPP) != LLAMACPP:
            return
        reported: Deferred[int] = protocol.next_cancelled()
        reported.addTimeout(CANCEL_REPORT_SECS, self._clock)
        model = instance.entry.name

        def counted(tokens: int) -> None:
            record(tokens)
            log.info(
                "{model}: the client left; the {tokens} tokens the engine used for it were counted against its key",
                model=model,
                tokens=tokens,
            )

        def nothing(failure: Failure) -> None:
            failure.trap(DeferredTimeout, CancelledError)

        reported.addCallbacks(counted, nothing).addErrback(
            lambda f: log.failure("counting an abandoned request's tokens", f)
        )


def _stopping(instance: Any) -> bool:
    """
    Whether a child is being stopped or is gone (a remote never is).
    """
    return bool(getattr(instance, "stop_reason", "")) or getattr(instance, "state", None) in (
        InstanceState.STOPPING,
        InstanceState.DEAD,
    )


def _retry_after(response: Any) -> float | None:
    """
    A response's C{Retry-After} in seconds (its delta-seconds form; a
    date is not read), at most an hour.
    """
    raw = response.headers.getRawHeaders(b"retry-after") if getattr(response, "headers", None) else None
    try:
        seconds = float(raw[0]) if raw else None
    except ValueError:
        return None
    return None if seconds is None or not seconds >= 0 else min(seconds, 3600.0)


def header_timeout_of(config: Config, instance: Any) -> tuple[str, float]:
    """
    How long a child may take to send its response headers before its
    health is asked (the config key, and seconds): an sd-server writes
    them only when the whole image is done, so it gets
    C{sdcpp_child_header_timeout_secs}; every other child
    C{child_header_timeout_secs}.
    """
    if getattr(instance, "lane", "") == SDCPP:
        return "sdcpp_child_header_timeout_secs", config.sdcpp_child_header_timeout
    if is_remote(instance):
        return "remotes.timeout_secs", instance.remote.timeout
    return "child_header_timeout_secs", config.child_header_timeout


def _wedged(config: Config, instance: Any, doing: str, times: str = "") -> EngineTimeout:
    """
    The error for a child that went silent and stopped answering its
    health check (it has been stopped): what it was C{doing}, for how
    long (L{header_timeout_of}), C{times} after the health check (C{",
    twice"}).
    """
    key, secs = header_timeout_of(config, instance)
    return EngineTimeout(
        instance.entry.name,
        f"{getattr(instance, 'server', 'llama-server')} for model {instance.entry.name!r} {doing} for {key} = "
        f"{secs:g} s and stopped answering its health check{times}; it was stopped",
    )
