"""
Sessions and the KV bank: a conversation keeps its prompt cache across
turns, slots, evictions and restarts.

A session is named by the client (C{x-blazar-session: NAME}) or by what
coding agents already send (L{session_name}); it belongs to the API key
that made it and to one model. While it is active it owns one slot of its
model's child: its requests go to that slot (llama-server's C{id_slot}),
so the slot's KV cache is the conversation's. When the slot must be given
up — another session needs it and none is free, or the child stops (idle,
C{keep_alive}, capacity, C{blazar evict}, daemon stop) — the slot is saved
to disk (llama-server's C{POST /slots/N?action=save}, under
C{--slot-save-path <data_dir>/sessions/<model>}), and before the
session's next request it is restored into a free slot
(C{?action=restore}). A bank entry is tied to the model file, the engine
binary and the context per slot it was made with (L{shape_of}) and is
never restored into a child of another shape; a restore that fails or
restores another token count than was saved is counted and logged, the
slot erased, and the request prefilled as if there had been no bank.

A session unused for C{session_keep_secs} is dropped with its bank entry.
Entries are kept in the store (C{sessions}) so that a daemon restart finds
them. With C{[cluster] database}, several nodes share that table, and it
is the KV bank's index: each row names the node that holds the session
(its slot, its bank file), written when the node pins the session
(L{Sessions.pin}: the node I{claims} it), so that another node that gets
one of its requests forwards it there (L{blazar.web.sessionroute}). A
node reads back only its own rows at start.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs
from twisted.internet.defer import CancelledError, Deferred, DeferredLock, ensureDeferred
from twisted.logger import Logger
from zope.interface import Attribute, Interface, implementer

from blazar import strictjson
from blazar.engines.llamacpp import DEFAULT_PARALLEL, slot_save_dir
from blazar.engines.supervisor import child_shape, thd_identity
from blazar.gateway.engine_proxy import was_cancelled
from blazar.httpbody import read_body

log = Logger()

SESSION_HEADER = "x-blazar-session"
# the sessions of conversations no client named: a child's other slots,
# saved when it stops and restored into the same slots when it is next used
AUTO_KEY = "\0auto"
MAX_SESSIONS_PER_KEY = 256
# what others send, in the order they are looked at after the header: GIE / llm-d's
# x-session-id, then the coding agents'
IMPLICIT_HEADERS = ("x-session-id", "x-claude-code-session-id", "session-id")
MAX_NAME = 200


def session_name(header: Callable[[str], str | None], hint: str | None) -> str | None:
    """
    The session a request names: C{x-blazar-session}, else GIE's
    C{x-session-id}, else Claude Code's C{X-Claude-Code-Session-Id} or Codex's C{session-id} header, else
    C{hint} (what the surface found in its body: Anthropic
    C{metadata.user_id}'s C{session_id}, Responses C{prompt_cache_key}).

    @param header: A request header's value by lower-case name.
    @return: The name (at most L{MAX_NAME} characters: L{_bounded_name}),
        or L{None}.
    """
    for name in (SESSION_HEADER, *IMPLICIT_HEADERS):
        value = header(name)
        if value and value.strip():
            return _bounded_name(value.strip())
    if hint and hint.strip():
        return _bounded_name(hint.strip())
    return None


def _bounded_name(name: str) -> str:
    """
    C{name}, or, past L{MAX_NAME} characters, its start and a hash of the
    whole (two long names that share a start stay two sessions).
    """
    if len(name) <= MAX_NAME:
        return name
    return name[: MAX_NAME - 33] + "#" + hashlib.sha256(name.encode("utf-8", "replace")).hexdigest()[:32]


def anthropic_hint(body: dict[str, Any]) -> str | None:
    """
    The C{session_id} in Anthropic C{metadata.user_id} (Claude Code sends
    it as a JSON string: C{{"device_id": ..., "session_id": ...}}).
    """
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(user_id, str) or "session_id" not in user_id:
        return None
    try:
        parsed = json.loads(user_id)
    except ValueError:
        return None
    value = parsed.get("session_id") if isinstance(parsed, dict) else None
    return value if isinstance(value, str) and value else None


bank_dir = slot_save_dir


def thd_shape(model_path: str, binary: str, ctx: int) -> str:
    """
    The shape of a child that did not take one at its start (a test's
    fake): the supervisor's own, from the files as they are now and the
    context per slot (L{blazar.engines.supervisor.child_shape}).
    """
    return child_shape(thd_identity(Path(model_path), Path(binary)), [f"ctx={ctx}"])


class SlotActionFailed(Exception):
    """
    A child refused or failed a slot save, restore or erase.

    @ivar transient: The child did not answer (no answer in time, not
        reachable): the slot file may still be good. L{False}: the child
        answered that it failed (a missing or damaged file).
    """

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class ISlotBank(Interface):
    """
    Slot saves and restores on one child (llama-server's C{/slots/N}).
    """

    async def save(instance: Any, slot: int, filename: str, timeout: float) -> tuple[int, int]:
        """
        Save C{slot} to C{filename} (under the child's slot save path).

        @return: Tokens saved, bytes written.
        @raise SlotActionFailed: The child refused it.
        """

    async def restore(instance: Any, slot: int, filename: str, timeout: float) -> int:
        """
        Restore C{filename} into C{slot}.

        @return: Tokens restored.
        @raise SlotActionFailed: The child refused it (a missing or
            corrupted file, a context too small).
        """

    async def erase(instance: Any, slot: int, timeout: float) -> None:
        """
        Empty C{slot}'s KV cache.
        """

    async def slots(instance: Any, timeout: float) -> list[tuple[int, bool, bool]]:
        """
        Each slot as C{(id, used, busy)}: it has held a prompt, a task runs
        in it now (C{GET /slots}).
        """


@implementer(ISlotBank)
class EngineSlots:
    """
    L{ISlotBank} on llama-server children: C{POST /slots/N?action=...}
    with the child's key, over the engine client, each bounded.
    """

    def __init__(self, engines: Any, clock: Any) -> None:
        self._engines = engines
        self._clock = clock

    async def _bounded(self, work: Any, timeout: float, what: str) -> Any:
        """
        Await C{work} (a coroutine) at most C{timeout} seconds. A client that
        leaves meanwhile raises C{CancelledError}; no answer in time, or
        none at all (the child is gone), L{SlotActionFailed} (transient).
        """
        d = ensureDeferred(work)
        timed_out = []

        def expire() -> None:
            timed_out.append(True)
            d.cancel()

        timer = self._clock.callLater(timeout, expire)
        try:
            return await d
        except SlotActionFailed:
            raise
        except Exception as e:
            if timed_out:
                raise SlotActionFailed(
                    f"{what}: no answer in {timeout:g} s (session_save_timeout_secs)", transient=True
                ) from None
            if was_cancelled(e):
                raise CancelledError() from None
            raise SlotActionFailed(f"{what}: {str(e) or type(e).__name__}", transient=True) from None
        finally:
            if timer.active():
                timer.cancel()

    async def _action(self, instance: Any, slot: int, action: str, body: dict[str, Any], timeout: float) -> Any:
        async def go() -> Any:
            response = await self._engines.request(
                "POST",
                f"{instance.base_url}/slots/{slot}?action={action}",
                strictjson.encode(body).encode("utf-8"),
                {**instance.auth_headers, b"content-type": [b"application/json"]},
                stream=False,
            )
            data = await read_body(response, self._clock, idle_timeout=timeout, max_bytes=1 << 16)
            try:
                parsed = json.loads(data)
            except ValueError:
                parsed = {}
            if response.code != 200:
                error = parsed.get("error") if isinstance(parsed, dict) else None
                message = error.get("message") if isinstance(error, dict) else None
                raise SlotActionFailed(f"{action}: {response.code} {message or data[:200]!r}")
            return parsed

        return await self._bounded(go(), timeout, action)

    async def save(self, instance: Any, slot: int, filename: str, timeout: float) -> tuple[int, int]:
        done = await self._action(instance, slot, "save", {"filename": filename}, timeout)
        return int(done.get("n_saved") or 0), int(done.get("n_written") or 0)

    async def restore(self, instance: Any, slot: int, filename: str, timeout: float) -> int:
        done = await self._action(instance, slot, "restore", {"filename": filename}, timeout)
        return int(done.get("n_restored") or 0)

    async def erase(self, instance: Any, slot: int, timeout: float) -> None:
        await self._action(instance, slot, "erase", {}, timeout)

    async def slots(self, instance: Any, timeout: float) -> list[tuple[int, bool, bool]]:
        status, body = await self._bounded(
            self._engines.get(f"{instance.base_url}/slots", instance.auth_headers, timeout=timeout),
            timeout,
            "slots",
        )
        if status != 200:
            raise SlotActionFailed(f"slots: {status} {body[:200]!r}")
        # a slot that never ran a task shows no id_task
        return [
            (int(s["id"]), s.get("id_task") is not None, bool(s.get("is_processing")))
            for s in json.loads(body)
            if isinstance(s, dict)
        ]


@attrs.frozen
class BankEntry:
    """
    A saved slot: C{file} (relative to the model's bank directory), the
    tokens and bytes saved, the L{thd_shape} it was made with, when.
    """

    file: str
    tokens: int
    size: int
    shape: str
    saved_at: float


@attrs.define(eq=False)
class Session:
    """
    One conversation of one key on one model.

    @ivar instance: The child whose slot C{slot} holds this session's KV
        cache, if any.
    """

    key: str
    name: str
    model: str
    last_used: float
    slot: int | None = None
    instance: Any = None
    bank: BankEntry | None = None
    tokens: int = 0
    in_flight: int = 0
    # the index (the store's row) names this node as its holder: written at its first pin
    claimed: bool = False

    @property
    def file(self) -> str:
        digest = hashlib.sha256(f"{self.key}\0{self.name}\0{self.model}".encode("utf-8")).hexdigest()
        return f"{digest[:32]}.bin"

    def view(self, node: str = "") -> dict[str, Any]:
        """
        What C{GET /api/session} shows of it, C{node} the name of the node
        that holds it (this one).
        """
        return {
            "session": self.name,
            "model": self.model,
            "node": node,
            "slot": self.slot if self.instance is not None else None,
            "last_used": self.last_used,
            "tokens_cached": self.tokens,
            "saved": self.bank is not None,
            "saved_tokens": self.bank.tokens if self.bank is not None else 0,
        }


@attrs.define(eq=False)
class Pin:
    """
    A request's hold on its session's slot (L{Sessions.pin}); ended by
    L{Sessions.release}.
    """

    session: Session
    slot: int


class ISessions(Interface):
    """
    The session table, as the control socket uses it.
    """

    enabled = Attribute("Whether sessions are on (C{session_keep_secs} above 0).")
    node = Attribute("This node's name (C{blazar.config.node_name}): the holder of the sessions listed.")

    def of_key(key: str | None) -> list[Session]:
        """
        The sessions of C{key} (every key's for L{None}), most recent first.
        """

    def close(key: str | None, name: str) -> list[Session]:
        """
        End C{key}'s sessions named C{name} (any key's for L{None}); the
        sessions ended.
        """


@implementer(ISessions)
class Sessions:
    """
    The sessions of every key and model (see the module docstring).

    @param bank: Saves and restores slots (L{ISlotBank}).
    @param settings: C{() -> (keep_secs, save_timeout, entry_max_bytes,
        bank_max_bytes)}, from the live config.
    @param run: C{run(f, *args)}: a blocking C{thd_*} function on a thread,
        as a Deferred.
    @param persist: C{persist(session)}: write its row (bank entry and last
        use); C{forget(session)}: delete it. Both return Deferreds.
    @param count: C{count(op, result)}: a metrics counter.
    @param claim: C{claim(session)}: write its row naming this node as its
        holder (the KV bank's index), whoever held it before; a Deferred.
    @param node: This node's name (C{blazar.config.node_name}), as the
        listing shows it.
    """

    def __init__(
        self,
        clock: Any,
        bank: ISlotBank,
        data_dir: Callable[[], Path],
        settings: Callable[[], tuple[float, float, int, int]],
        run: Callable[..., Deferred[Any]],
        persist: Callable[[Session], Deferred[Any]] | None = None,
        forget: Callable[[Session], Deferred[Any]] | None = None,
        count: Callable[[str, str], None] | None = None,
        claim: Callable[[Session], Deferred[Any]] | None = None,
        node: str = "",
    ) -> None:
        self._clock = clock
        self._claim = claim
        self.node = node
        # with [cluster] database: every node's sessions of a key (or every key's), as the index has
        # them: (key, name, model, node, last_used) rows
        self.index: Callable[[str | None], Deferred[list[tuple[str, str, str, str, float]]]] | None = None
        self._bank = bank
        self._data_dir = data_dir
        self._settings = settings
        self._run = run
        self._persist = persist
        self._forget = forget
        self._count = count or (lambda op, result: None)
        self._sessions: dict[tuple[str, str, str], Session] = {}
        # per child: who owns each slot
        self._owners: dict[int, tuple[Any, list[Session | None]]] = {}
        self._locks: dict[int, DeferredLock] = {}
        self._shapes: dict[int, str] = {}
        self._warming: dict[int, tuple[Any, Deferred[None]]] = {}
        self.pending: set[Deferred[Any]] = set()

    # -- what clients see --------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._settings()[0] > 0

    def of_key(self, key: str | None) -> list[Session]:
        """
        The sessions of C{key} (every key's for L{None}), most recent first.
        """
        found = [s for s in self._sessions.values() if key is None or s.key == key]
        return sorted(found, key=lambda s: -s.last_used)

    def close(self, key: str | None, name: str) -> list[Session]:
        """
        End C{key}'s sessions named C{name} (on every model; any key's for
        L{None}, the control socket): their slots are given up and their
        bank entries deleted.

        @return: The sessions ended (none: no such session of that key).
        """
        closed = [s for s in list(self._sessions.values()) if s.name == name and (key is None or s.key == key)]
        for session in closed:
            instance, slot = session.instance, session.slot
            self._drop(session)
            if instance is not None and slot is not None:
                # the conversation is gone from the child too (else the slot
                # would be saved again, unnamed, when the child stops)
                self._track(ensureDeferred(self._erase(instance, slot)))
        return closed

    async def _erase(self, instance: Any, slot: int) -> None:
        try:
            await self._bank.erase(instance, slot, self._settings()[1])
        except Exception as e:
            log.warn(
                "{model}: erasing slot {slot} of a closed session failed: {error}",
                model=instance.entry.name,
                slot=slot,
                error=str(e) or type(e).__name__,
            )

    def load(self, sessions: Sequence[Session]) -> None:
        """
        Sessions read back from the store at start (bank entries, no slot).
        """
        for session in sessions:
            session.claimed = True  # (its row names this node: a node reads back only its own)
            self._sessions[(session.key, session.name, session.model)] = session

    def disown(self, key: str, name: str) -> None:
        """
        The index names another node as the holder of C{key}'s sessions
        named C{name}, and this node is taking them over (that node could
        not be reached): their next pin here claims them again.
        """
        for session in self._sessions.values():
            if session.key == key and session.name == name:
                session.claimed = False

    # -- the pipeline's step ----------------------------------------------

    async def pin(self, key: str, name: str, instance: Any) -> Pin | None:
        """
        The slot of C{instance} that C{key}'s session C{name} uses for its
        next request: the one it owns, else a free one, else the least
        recently used idle session's (saved to the bank first); its bank
        entry, if any and of this child's shape, restored into it.

        @return: L{None} when sessions are off, or every slot is held by a
            session with a request running (the request goes unpinned).
        """
        if not self.enabled:
            return None
        model = instance.entry.name
        session = self._sessions.get((key, name, model))
        now = self._clock.seconds()
        if session is None:
            self._make_room(key)
            session = self._sessions[(key, name, model)] = Session(key, name, model, now)
        session.last_used = now
        if not session.claimed and self._claim is not None:
            # the index names this node from now on (a request for it on another node comes here)
            session.claimed = True
            self._track(self._claim(session))
        lock = self._locks.setdefault(id(instance), DeferredLock())
        await lock.acquire()
        try:
            slot = await self._slot_for(session, instance)
            if slot is None:
                return None
            session.in_flight += 1
            return Pin(session, slot)
        finally:
            lock.release()

    def _make_room(self, key: str) -> None:
        """
        At most L{MAX_SESSIONS_PER_KEY} sessions per key: the least recently
        used idle ones go first.
        """
        mine = [s for s in self._sessions.values() if s.key == key]
        if len(mine) < MAX_SESSIONS_PER_KEY:
            return
        idle = sorted((s for s in mine if s.in_flight == 0), key=lambda s: s.last_used)
        for session in idle[: len(mine) - MAX_SESSIONS_PER_KEY + 1]:
            self._drop(session)

    async def warm(self, instance: Any) -> None:
        """
        Once per child, before its first request: the slots of
        conversations no client named that its predecessor held (saved when
        it stopped) are restored into the same slots, so that llama-server,
        which gives a request the slot whose cache shares the most of its
        prompt, finds them.
        """
        if not self.enabled:
            return
        held = self._warming.get(id(instance))
        if held is not None and held[0] is instance:
            if not held[1].called:
                await held[1]
            return
        done: Deferred[None] = Deferred()
        self._warming[id(instance)] = (instance, done)
        try:
            model = instance.entry.name
            owners = self._owners_of(instance)
            for session in list(self._sessions.values()):
                if session.key != AUTO_KEY or session.model != model or session.bank is None:
                    continue
                slot = int(session.name.rsplit("-", 1)[1])
                if slot < len(owners) and owners[slot] is None:
                    await self._restore(session, instance, slot)  # (no answer: kept for the next child)
        finally:
            done.callback(None)

    def release(self, pin: Pin, tokens: int | None) -> None:
        """
        A pinned request ended; C{tokens} (prompt + completion, as the
        engine reported them) is what its slot now holds.
        """
        session = pin.session
        session.in_flight = max(0, session.in_flight - 1)
        session.last_used = self._clock.seconds()
        if tokens:
            session.tokens = tokens

    async def _slot_for(self, session: Session, instance: Any) -> int | None:
        owners = self._owners_of(instance)
        if session.instance is instance and session.slot is not None and owners[session.slot] is session:
            return session.slot
        session.instance, session.slot = None, None
        busy = await self._busy(instance)
        # a slot no session owns and no request runs in; else the least
        # recently used idle session's (an unnamed request llama-server put
        # in a slot would hold a restore back until it ends)
        slot = next((i for i, owner in enumerate(owners) if owner is None and i not in busy), None)
        if slot is None:
            idle = [o for i, o in enumerate(owners) if o is not None and o.in_flight == 0 and i not in busy]
            if not idle:
                return None  # unpinned: llama-server picks a slot
            victim = min(idle, key=lambda o: o.last_used)
            slot = owners.index(victim)
            await self._page_out(victim, instance)
        owners[slot] = session
        session.instance, session.slot = instance, slot
        if session.bank is not None and not await self._restore(session, instance, slot):
            # the child did not answer (gone, or wedged): unpinned, the entry
            # kept for the next turn
            owners[slot] = None
            session.instance, session.slot = None, None
            return None
        return slot

    async def _busy(self, instance: Any) -> set[int]:
        """
        The slots a task runs in now (none if the child does not say).
        """
        try:
            return {slot for slot, _, busy in await self._bank.slots(instance, self._settings()[1]) if busy}
        except SlotActionFailed:
            return set()

    def _owners_of(self, instance: Any) -> list[Session | None]:
        for ident, (other, _) in list(self._owners.items()):
            if other is not instance and getattr(other, "state", None) in ("dead", "stopping"):
                self._lose(ident)
        held = self._owners.get(id(instance))
        if held is None or held[0] is not instance:
            slots = int(instance.entry.settings.parallel or DEFAULT_PARALLEL)
            held = self._owners[id(instance)] = (instance, [None] * slots)
        return held[1]

    def _lose(self, ident: int) -> None:
        _, owners = self._owners.pop(ident)
        self._shapes.pop(ident, None)
        self._locks.pop(ident, None)
        for owner in owners:
            if owner is not None:
                owner.instance, owner.slot = None, None

    async def _shape(self, instance: Any) -> str:
        """
        What a bank entry of this child is tied to: L{Instance.shape} (the
        model file and engine as it loaded them, its command line), else
        (a child without one) L{thd_shape} now.
        """
        shape = getattr(instance, "shape", "") or self._shapes.get(id(instance))
        if not shape:
            shape = await self._run(
                thd_shape, str(instance.entry.path), str(getattr(instance, "binary", "")), int(instance.ctx)
            )
            self._shapes[id(instance)] = shape
        return str(shape)

    async def _page_out(self, session: Session, instance: Any) -> None:
        """
        Save C{session}'s slot to the bank and give the slot up.
        """
        slot = session.slot
        session.instance, session.slot = None, None
        owners = self._owners_of(instance)
        if slot is not None and owners[slot] is session:
            owners[slot] = None
        if slot is None:
            return
        await self._save(session, instance, slot)

    async def _save(self, session: Session, instance: Any, slot: int) -> None:
        _, timeout, entry_max, bank_max = self._settings()
        shape = await self._shape(instance)
        # (the supervisor made the directory before the child started:
        # llama-server refuses a --slot-save-path that is not one)
        try:
            tokens, size = await self._bank.save(instance, slot, session.file, timeout)
        except CancelledError:
            raise
        except Exception as e:
            self._count("save", "failed")
            log.warn(
                "{model}: saving session {session}'s slot {slot} failed: {error}",
                model=session.model,
                session=session.name,
                slot=slot,
                error=str(e) or type(e).__name__,
            )
            return
        if tokens <= 0 or size > entry_max:
            if size > entry_max:
                log.warn(
                    "{model}: session {session}'s bank entry is {size} bytes, over "
                    "session_bank_entry_max_mib; not kept",
                    model=session.model,
                    session=session.name,
                    size=size,
                )
            self._count("save", "discarded")
            await self._run(_thd_unlink, bank_dir(self._data_dir(), session.model) / session.file)
            session.bank = None
            return
        session.bank = BankEntry(session.file, tokens, size, shape, self._clock.seconds())
        session.tokens = tokens
        self._count("save", "ok")
        self._track(self._persist(session) if self._persist is not None else None)
        await self._bound(bank_max)

    async def _restore(self, session: Session, instance: Any, slot: int) -> bool:
        """
        Restore C{session}'s bank entry into C{slot}. A definite failure (the
        child says the file is missing or damaged, or restored another
        token count than was saved) erases the slot and drops the entry:
        the prompt is prefilled. An entry of another shape is dropped
        unrestored.

        @return: L{False} if the child did not answer (the entry is kept).
        @raise CancelledError: The client left (the entry is kept).
        """
        bank = session.bank
        assert bank is not None
        _, timeout, _, _ = self._settings()
        shape = await self._shape(instance)
        if bank.shape != shape:
            # another model file, engine, context size or engine flags: never restored
            self._count("restore", "other_shape")
            log.info(
                "{model}: session {session}'s bank entry was made for another model file, engine, context "
                "size or engine flags; prefilling instead",
                model=session.model,
                session=session.name,
            )
            self._drop_bank(session)
            return True
        try:
            restored = await self._bank.restore(instance, slot, bank.file, timeout)
        except SlotActionFailed as e:
            if e.transient:
                self._count("restore", "no_answer")
                log.warn(
                    "{model}: restoring session {session}'s bank entry: {error}; the entry is kept for its next turn",
                    model=session.model,
                    session=session.name,
                    error=str(e),
                )
                return False
            restored, error = -1, str(e)
        else:
            error = f"restored {restored} tokens, {bank.tokens} were saved"
        if restored == bank.tokens:
            self._count("restore", "ok")
            session.tokens = restored
            return True
        self._count("restore", "failed")
        log.warn(
            "{model}: restoring session {session}'s bank entry into slot {slot} failed ({error}); "
            "the prompt is prefilled instead",
            model=session.model,
            session=session.name,
            slot=slot,
            error=error,
        )
        try:
            await self._bank.erase(instance, slot, timeout)
        except SlotActionFailed as e:
            log.warn(
                "{model}: erasing slot {slot} after a failed restore failed: {error}",
                model=session.model,
                slot=slot,
                error=str(e),
            )
        self._drop_bank(session)
        return True

    def _drop_bank(self, session: Session) -> None:
        if session.bank is None:
            return
        path = bank_dir(self._data_dir(), session.model) / session.bank.file
        session.bank = None
        self._track(self._run(_thd_unlink, path))
        self._track(self._persist(session) if self._persist is not None else None)

    async def _bound(self, bank_max: int) -> None:
        """
        Keep the bank's total size within C{bank_max} bytes, oldest saves
        dropped first.
        """
        banked = sorted(
            (s for s in self._sessions.values() if s.bank is not None),
            key=lambda s: s.bank.saved_at if s.bank is not None else 0.0,
        )
        total = sum(s.bank.size for s in banked if s.bank is not None)
        for session in banked:
            if total <= bank_max:
                break
            assert session.bank is not None
            total -= session.bank.size
            log.info(
                "session bank over session_bank_max_mib: dropping {session}'s entry ({model})",
                session=session.name,
                model=session.model,
            )
            self._drop_bank(session)

    def _drop(self, session: Session) -> None:
        self._sessions.pop((session.key, session.name, session.model), None)
        if session.instance is not None and session.slot is not None:
            held = self._owners.get(id(session.instance))
            if held is not None and held[1][session.slot] is session:
                held[1][session.slot] = None
        session.instance, session.slot = None, None
        if session.bank is not None:
            path = bank_dir(self._data_dir(), session.model) / session.bank.file
            session.bank = None
            self._track(self._run(_thd_unlink, path))
        self._track(self._forget(session) if self._forget is not None else None)

    def _track(self, d: Deferred[Any] | None) -> None:
        if d is None:
            return
        self.pending.add(d)

        def done(result: Any) -> Any:
            self.pending.discard(d)
            return result

        d.addBoth(done).addErrback(lambda f: log.failure("session bank bookkeeping failed", f))

    # -- the supervisor's hook and the reaper ---------------------------------

    async def before_stop(self, instance: Any) -> None:
        """
        The child is about to stop: save the slot of every session it holds
        (the most recently used first), within C{session_save_timeout_secs}
        each.
        """
        if instance.entry.settings.embedding or not getattr(instance, "kv_bank", True):
            return  # no --slot-save-path (embeddings, rerankers, command lanes): no KV worth keeping
        held = self._owners.get(id(instance))
        owners = [o for o in held[1] if o is not None] if held is not None and held[0] is instance else []
        owned = {o.slot for o in owners}
        for session in sorted(owners, key=lambda s: -s.last_used):
            if session.slot is not None:
                slot = session.slot
                await self._save(session, instance, slot)
        if self.enabled:
            await self._save_unnamed(instance, owned)
        if held is not None and held[0] is instance:
            self._lose(id(instance))
        if self._warming.get(id(instance), (None,))[0] is instance:
            del self._warming[id(instance)]

    async def _save_unnamed(self, instance: Any, owned: set[int | None]) -> None:
        """
        Save the slots no session owns (conversations no client named) as
        C{_auto-<slot>} entries of L{AUTO_KEY}.
        """
        _, timeout, _, _ = self._settings()
        try:
            used = [slot for slot, was_used, _ in await self._bank.slots(instance, timeout) if was_used]
        except SlotActionFailed as e:
            log.warn(
                "{model}: listing its slots before it stops failed ({error}); its unnamed conversations are not saved",
                model=instance.entry.name,
                error=str(e) or type(e).__name__,
            )
            return
        model = instance.entry.name
        now = self._clock.seconds()
        for slot in used:
            if slot in owned:
                continue
            name = f"_auto-{slot}"
            session = self._sessions.get((AUTO_KEY, name, model))
            if session is None:
                session = self._sessions[(AUTO_KEY, name, model)] = Session(AUTO_KEY, name, model, now)
            session.last_used = now
            await self._save(session, instance, slot)

    def stopping(self, instance: Any, after: Deferred[Any] | None = None) -> Deferred[None]:
        """
        L{before_stop} as a tracked Deferred (the supervisor's hook), once
        C{after} (if given: the batch lines draining at shutdown) has
        fired. Tracked from the call, so a stop of the store that waits for
        L{pending} waits for the wait as well as for the save.
        """

        async def stop() -> None:
            if after is not None:
                try:
                    await after
                except Exception:
                    log.failure("waiting before {model} stops failed; saving its slots now", model=instance.entry.name)
            await self.before_stop(instance)

        d: Deferred[None] = ensureDeferred(stop())
        self._track(d)
        return d

    def expire(self) -> int:
        """
        Drop the sessions unused for C{session_keep_secs} (none running).

        @return: How many were dropped.
        """
        keep = self._settings()[0]
        now = self._clock.seconds()
        old = [s for s in self._sessions.values() if s.in_flight == 0 and now - s.last_used > keep]
        for session in old:
            self._drop(session)
        return len(old)


def elsewhere(name: str, model: str, node: str, last_used: Any) -> dict[str, Any]:
    """
    What C{GET /api/session} shows of a session another node holds (by
    the KV bank's index): its name, model and node, and when it was last
    used; its slot and tokens are that node's to say.
    """
    return {
        "session": name,
        "model": model,
        "node": node,
        "slot": None,
        "last_used": last_used,
        "tokens_cached": 0,
        "saved": False,
        "saved_tokens": 0,
    }


def _thd_unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def sessions_from_rows(rows: Sequence[tuple[Any, ...]]) -> list[Session]:
    """
    Sessions from the store's rows (L{blazar.store.thd_sessions}).
    """
    out = []
    for key, name, model, file, tokens, size, shape, saved_at, last_used in rows:
        bank = BankEntry(file, int(tokens), int(size), shape, float(saved_at)) if file else None
        out.append(Session(key, name, model, float(last_used), bank=bank, tokens=int(tokens or 0)))
    return out
