"""
The model-server gauges Kubernetes' Gateway API Inference Extension (GIE)
and llm-d's endpoint picker read, under vLLM's names (docs/gie.md), per
model with the label C{model_name} (a model's canonical name):

 - C{vllm:num_requests_waiting}: requests waiting in Blazar's admission
   for a slot of the model (L{blazar.gateway.admission.ModelQueue.waiting});
 - C{vllm:num_requests_running}: requests holding a slot of the model now
   (admitted and not yet finished: L{ModelQueue.running});
 - C{vllm:kv_cache_usage_perc}: the share (0..1) of the KV cache of the
   model's ready llama-server children that requests running there hold:
   over every child's C{GET /slots}, the tokens in the slots that are
   processing (C{n_prompt_tokens}, which counts the prompt and what was
   generated so far) over all slots' C{n_ctx}. As in vLLM, where cached
   blocks no request holds count as free, the prompt cache an idle slot
   keeps counts as free: the next request may take the slot. The built
   llama-server has no KV gauge of its own in C{/metrics} (no
   C{llamacpp:kv_cache_usage_ratio}).

Waiting and running are read at scrape time from admission. The KV
share is asked of the children by L{ModelServerGauges.refresh}, which
C{GET /metrics} awaits before it renders (L{blazar.web.observe}), so a
scrape never shows an older state than its own; a child that does not
answer within L{SLOTS_TIMEOUT} is left out (its model's series with it,
when it was the only one), and logged once until it answers again.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Iterable

from prometheus_client.core import Metric
from twisted.internet.defer import Deferred, gatherResults
from twisted.logger import Logger

from blazar import strictjson
from blazar.engines.instance import InstanceState
from blazar.gateway.admission import Admission
from blazar.metrics import gauge

log = Logger()

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
LABEL = "model_name"
SLOTS_TIMEOUT = 1.0
SLOTS_MAX_BYTES = 4 << 20


def kv_of_slots(slots: Any) -> tuple[int, int]:
    """
    What one child's C{GET /slots} says about its KV cache: the tokens
    its processing slots hold and the tokens all its slots may hold.

    @param slots: The parsed C{/slots} answer: a list of objects with
        C{n_ctx}, C{is_processing} and (once used) C{n_prompt_tokens}.
    @return: C{(used, total)} in tokens.
    @raise ValueError: Not that shape.
    """
    if not isinstance(slots, list):
        raise ValueError("/slots is not a list")
    used = total = 0
    for slot in slots:
        if not isinstance(slot, dict):
            raise ValueError("a slot is not an object")
        n_ctx = slot.get("n_ctx")
        if not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx < 0:
            raise ValueError("a slot has no n_ctx")
        total += n_ctx
        tokens = slot.get("n_prompt_tokens", 0)
        if slot.get("is_processing") is True and isinstance(tokens, int) and not isinstance(tokens, bool):
            used += max(0, min(tokens, n_ctx))
    return used, total


def queue_counts(admission: Admission, model: str) -> tuple[int, int]:
    """
    C{(waiting, running)}: the requests waiting in admission for a slot of
    C{model} (a canonical name) and those holding one now, as
    C{vllm:num_requests_waiting} and C{vllm:num_requests_running} show
    them (and C{blazar cluster}: L{blazar.gateway.nodes}).
    """
    queue = admission.queues.get(model)
    if queue is None:
        return 0, 0
    return len(queue.waiting), len(queue.running)


class ModelServerGauges:
    """
    The vLLM-named gauges, for all models (C{GET /metrics}, through
    L{blazar.metrics.Metrics.gauges}) or one (C{GET /metrics/models/NAME}).

    @param admission: The admission queues (waiting, running).
    @param instances: The supervisor's live children (objects with
        C{state}, C{lane}, C{pid}, C{base_url}, C{auth_headers},
        C{entry.name}).
    @param fetch: GETs a URL with headers, a timeout and a body bound:
        C{(status, body)} (the engine client's C{get}).
    """

    def __init__(
        self,
        admission: Admission,
        instances: Callable[[], list[Any]],
        fetch: Callable[..., Awaitable[tuple[int, bytes]]],
    ) -> None:
        self._admission = admission
        self._instances = instances
        self._fetch = fetch
        # model -> (tokens held by running requests, tokens of all slots), as of the last refresh
        self.kv: dict[str, tuple[int, int]] = {}
        self._failing: set[int | None] = set()

    async def refresh(self, model: str | None = None) -> None:
        """
        Ask every ready llama-server child (of C{model}, or of all models)
        for its slots, at once. Never raises.
        """
        children = [
            i
            for i in self._instances()
            if i.state == InstanceState.READY
            and getattr(i, "lane", "llamacpp") == "llamacpp"
            and (model is None or i.entry.name == model)
        ]
        answers = await gatherResults([Deferred.fromCoroutine(self._slots(i)) for i in children])
        asked = {i.entry.name for i in children}
        # a model with no ready child holds no KV cache
        fresh = {name: (0, 0) for name in self._models(model) if name not in asked}
        for instance, answer in zip(children, answers):
            if answer is not None:
                used, total = fresh.get(instance.entry.name, (0, 0))
                fresh[instance.entry.name] = (used + answer[0], total + answer[1])
        if model is None:
            self.kv = fresh
        else:
            self.kv.pop(model, None)
            self.kv.update(fresh)

    async def _slots(self, instance: Any) -> tuple[int, int] | None:
        try:
            status, body = await self._fetch(
                instance.base_url + "/slots", instance.auth_headers, timeout=SLOTS_TIMEOUT, max_bytes=SLOTS_MAX_BYTES
            )
            if status != 200:
                raise ValueError(f"the engine answered /slots with {status}")
            found = kv_of_slots(strictjson.loads(body))
        except Exception as e:
            if instance.pid not in self._failing:
                self._failing.add(instance.pid)
                log.warn(
                    "cannot read {model}'s engine /slots for vllm:kv_cache_usage_perc: {error}",
                    model=instance.entry.name,
                    error=str(e) or repr(e),
                )
            return None
        if instance.pid in self._failing:
            self._failing.discard(instance.pid)
            log.info("reading {model}'s engine /slots works again", model=instance.entry.name)
        return found

    def _models(self, model: str | None) -> list[str]:
        if model is not None:
            return [model]
        return sorted(set(self._admission.queues) | {i.entry.name for i in self._instances()})

    def families(self, model: str | None = None) -> Iterable[Metric]:
        """
        The three gauges for C{model} (a canonical name), or for every
        model admission or the supervisor knows.
        """
        names = self._models(model)

        def count(name: str, running: bool) -> float:
            return float(queue_counts(self._admission, name)[1 if running else 0])

        def share(used: int, total: int) -> float:
            return min(1.0, used / total) if total > 0 else 0.0

        yield gauge(
            WAITING, "Requests waiting in Blazar's admission for a slot of the model", [LABEL],
            [([n], count(n, False)) for n in names],
        )  # fmt: skip
        yield gauge(
            RUNNING, "Requests holding a slot of the model (admitted, not yet finished)", [LABEL],
            [([n], count(n, True)) for n in names],
        )  # fmt: skip
        yield gauge(
            KV_USAGE,
            "Share (0..1) of the model's llama-server KV cache that running requests hold, from the children's /slots",
            [LABEL],
            [([n], share(*self.kv[n])) for n in names if n in self.kv],
        )

    def collect(self) -> Iterable[Metric]:
        """
        L{families} for every model (a L{blazar.metrics.Metrics.gauges}
        callback).
        """
        return self.families()
