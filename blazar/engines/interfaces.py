"""
The supervisor's seam: L{ISupervisor}, what the request path, the control
socket and the metrics use, and the L{IInstance}s it hands out
(L{blazar.testing.FakeSupervisor} provides them too, checked by one shared
contract test: tests/engines/test_supervisor_contract.py). The engine
client's is L{blazar.engines.client.IEngineClient}.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from twisted.internet.defer import Deferred
from zope.interface import Attribute, Interface

from blazar.config import Config
from blazar.engines.breaker import Breaker
from blazar.engines.errors import EngineError
from blazar.engines.growth import ContextPlan
from blazar.engines.instance import IInstance, InstanceView
from blazar.models.gguf_meta import GGUFMetadata
from blazar.models.registry import ModelEntry

__all__ = ["IInstance", "ISupervisor"]


class ISupervisor(Interface):
    """
    Starts, tracks and stops engine children: what the request path, the
    control socket and the metrics use.
    """

    ctx_policy = Attribute('C{"grow"} or C{"fit"} (the config\'s C{ctx_policy}).')

    async def instance_for(name: str, ctx_size: int | None = None) -> IInstance:
        """
        A ready L{IInstance} for the model a client named, started if need be.

        @raise blazar.models.registry.ModelNotFound: No such model.
        @raise EngineError: It could not be started (L{EngineStartFailed},
            L{NoCapacity}, L{BreakerOpen}).
        """

    async def want_profile(name: str, wishes: Mapping[str, Any]) -> None:
        """
        The placement a client asks for (profile keys and values); a loaded
        child with another is reloaded for it by the next L{instance_for}.
        """

    async def context_for(name: str, ctx_size: int) -> ContextPlan:
        """
        The context per slot a request asking for C{ctx_size} tokens runs with.
        """

    def loaded(name: str) -> IInstance | None:
        """
        The live L{IInstance} for canonical model C{name}, or L{None}.
        """

    def instances() -> Sequence[IInstance]:
        """
        Every live L{IInstance} (starting, ready or stopping), oldest first.
        """

    def snapshot() -> list[InstanceView]:
        """
        A read-only L{InstanceView} of each live instance, oldest first
        (C{rss} not measured: no I/O).
        """

    async def measured_snapshot() -> list[InstanceView]:
        """
        L{snapshot}, with each child's resident memory read in the thread
        pool.
        """

    def touch(instance: Any, keep_alive: float | None = None) -> None:
        """
        Record a use of C{instance}; C{keep_alive} (seconds, negative for
        forever) replaces its idle time when given.
        """

    def stop_instance(instance: Any, reason: str = "requested") -> Deferred[Any]:
        """
        SIGTERM it (SIGKILL after C{stop_grace}); it leaves the table at
        once; fires with its L{ExitStatus} once it has exited.
        """

    def unload_when_idle(instance: Any, reason: str) -> Deferred[Any] | None:
        """
        Stop C{instance} now if no request runs on it (the result of
        L{stop_instance}); else once the last one ends (its lease stops it;
        L{None}). Ollama's unload: it never cuts a running answer.
        """

    def kill_instance(instance: Any, reason: str) -> Deferred[Any]:
        """
        As L{stop_instance}, with SIGKILL at once (a wedged child).
        """

    async def probe_health(instance: Any) -> bool:
        """
        Whether its C{/health} answers 200 within 3 seconds.

        @raise CancelledError: The caller was cancelled: never L{False}.
        """

    def exited(instance: Any) -> bool:
        """
        Whether its child has exited, reported or not; a ready one found
        exited is dead from then on and leaves the table.
        """

    async def explain_failure(instance: Any, error: BaseException) -> EngineError:
        """
        An L{EngineCrashed} naming how the child ended, for a connection
        to it that broke with C{error}.
        """

    def remote_failed(instance: Any, error: str) -> str:
        """
        A remote instance could not be reached, timed out or answered 5xx:
        counted against its model's breaker, as a crash is; C{error}
        without the remote's key.
        """

    def remote_ok(instance: Any) -> None:
        """
        A remote instance answered: a half-open breaker closes.
        """

    def breaker(name: str) -> Breaker:
        """
        The crash breaker for canonical model C{name}.
        """

    def reset_breakers(name: str | None = None) -> list[str]:
        """
        Close the breakers of C{name}, or of every model; the models reset.
        """

    def evict(key: str) -> Sequence[IInstance]:
        """
        Stop the instances C{key} (C{name}, C{name#replica}, C{name@lane})
        names; the instances being stopped.
        """

    def estimate(entry: ModelEntry, meta: GGUFMetadata) -> int:
        """
        Bytes a child for C{entry} needs (weights plus KV cache).
        """

    def reconfigure(config: Config) -> None:
        """
        Use C{config} from now on; running children are not touched.
        """
