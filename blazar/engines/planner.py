"""
The placement planner: what a model needs in memory, and where it goes.

Pure: no I/O, no reactor, no clock. The supervisor gathers the facts (the
model's GGUF metadata, what each GPU has free, what the loaded models hold,
the free RAM, the model's launch-profile keys) and asks L{place}, which
answers with a L{Plan} (devices, tensor split, C{-ngl}, evictions, expected
bytes per GPU) or a L{NoFit} whose message names the levers.

How llama.cpp places a model (C{src/llama-model.cpp}, C{load_tensors}, as
pinned; the planner follows it so that its figures are the child's):
  - The model is C{n_layer} repeating blocks and one "output layer" (the
    output norm and head): C{n_layer + 1} units. C{-ngl k} puts the B{last}
    C{k} units on the GPU(s): the output layer first, then the blocks from
    the top down (C{i_gpu_start = n_layer + 1 - k}); C{-ngl n_layer + 1}
    is everything.
  - The input layer (the token embedding) always stays on the CPU. A model
    whose output head is tied to its embedding loads that tensor a second
    time on the output layer's device
    (L{blazar.models.gguf_meta.GGUFMetadata.output_bytes}).
  - Each block's KV cache lives on the block's device (C{offload_kqv} is
    on by default).
  - Across devices, unit C{j} of the C{k} GPU units goes to the first
    device whose cumulative, normalised C{--tensor-split} share exceeds
    C{j / k}. With integer shares equal to the unit counts the planner
    chose, device C{i} gets exactly C{shares[i]} units: that is the split
    L{Plan.tensor_split} gives.
  - Every device that computes a part of the graph reserves a compute
    buffer sized for the worst-case micro-batch (L{compute_bytes}).

The estimate (L{estimate_need}), per device:
  - B{weights}: the GGUF's tensor bytes per block
    (L{GGUFMetadata.layer_bytes}) for the blocks it holds, plus
    C{output_bytes} on the device of the output layer;
  - B{KV cache}: for each block it holds, C{cells x (n_head_kv x key_length
    x bytes(cache_type_k) + n_head_kv x value_length x bytes(cache_type_v))},
    where llama-server (with an explicit C{-np}, so a non-unified cache of
    one stream per slot) has C{cells = parallel x pad256(ctx_per_slot)},
    and a sliding-window block C{parallel x pad256(min(stream, window +
    n_ubatch))} (C{src/llama-kv-cache-iswa.cpp}); bytes per element are
    ggml's block sizes (L{CACHE_TYPE_BYTES}: f16 2, q8_0 34/32, q4_0
    18/32, ...);
  - B{compute buffer}: L{compute_bytes}, fitted to what the pinned
    llama-server reports (C{sched_reserve: ... compute buffer size}) for
    SmolLM2-135M at 2k-16k tokens per slot, flash attention on and off:
    within 1 % with flash attention, about 8 % above without;
  - B{overhead}: L{DEVICE_OVERHEAD} per GPU for the CUDA context, cuBLAS
    and ggml's CUDA memory pool, which NVML counts against the child but
    llama.cpp does not report;
  - the model's B{measured correction} (what NVML showed for its child
    last time minus what was planned: L{correction}), spread over the
    GPUs it uses in proportion to their planned bytes.
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable, Iterable, Mapping, Sequence

import attrs

from blazar.models.gguf_meta import GGUFMetadata

MiB = 1 << 20
GiB = 1 << 30

# ggml's block sizes for the KV cache types llama-server takes (-ctk/-ctv):
# (bytes per block, elements per block), as in ggml.c's type_traits.
CACHE_TYPE_BYTES: Mapping[str, tuple[int, int]] = {
    "f32": (4, 1),
    "f16": (2, 1),
    "bf16": (2, 1),
    "q8_0": (34, 32),
    "q4_0": (18, 32),
    "q4_1": (20, 32),
    "iq4_nl": (18, 32),
    "q5_0": (22, 32),
    "q5_1": (24, 32),
}

# llama.cpp's default micro-batch (-ub): the compute buffer is sized for it.
DEFAULT_UBATCH = 512

# Per GPU, beyond what llama.cpp allocates: a CUDA context with lazy module
# loading (the default since CUDA 12.2) takes roughly 250-350 MiB on
# Ampere and Hopper, cuBLAS's handle and workspace and ggml's CUDA pool a few
# tens more. Rounded up; the measured correction takes the rest.
DEVICE_OVERHEAD = 384 * MiB

# llama.cpp pads its context and KV cache streams to this many cells.
_PAD = 256


def _pad(n: int) -> int:
    return -(-n // _PAD) * _PAD


def kv_bytes(elements: int, cache_type: str) -> int:
    """
    Bytes of C{elements} KV cache elements stored as C{cache_type}
    (ggml's C{ggml_row_size}: whole blocks).

    @raise ValueError: An unknown type.
    """
    try:
        size, block = CACHE_TYPE_BYTES[cache_type]
    except KeyError:
        raise ValueError(f"unknown KV cache type {cache_type!r}: one of {', '.join(CACHE_TYPE_BYTES)}") from None
    return -(-elements // block) * size


def compute_bytes(meta: GGUFMetadata, ctx_per_slot: int, flash_attn: bool, n_ubatch: int = DEFAULT_UBATCH) -> int:
    """
    The compute buffer llama.cpp reserves on each device that runs a part
    of the graph: f32 activations of one micro-batch of
    C{n = min(n_ubatch, context)} tokens, ggml's allocator reusing memory
    between operations, so the peak is one layer's widest moment:
      - C{5 x n_embd + 3 x n_ff} floats per token (the residual stream,
        norms, the feed-forward gate, up and activation);
      - without flash attention, the attention scores and mask of one
        stream, C{stream x (n_head + 1)} floats per token; with it only
        the f16 mask, C{stream / 2} floats per token (C{stream} =
        C{pad256(ctx_per_slot)}, the KV cells one slot sees).
    That is C{4 x n x (5 n_embd + 3 n_ff + attention)} bytes; C{n_ff}
    defaults to C{4 n_embd}. Against the pinned llama-server's own report
    it is within 1 % with flash attention and up to ~8 % high without (it
    adds the feed-forward's peak to the attention's, which llama.cpp does
    not hold at once): conservative on purpose.

    @param ctx_per_slot: Tokens of context per slot (C{-c} / C{-np}).
    @param flash_attn: Whether the child runs with flash attention
        (C{-fa on}; C{auto} turns it on for CUDA builds that support the
        model: pass L{False} when unsure, the larger figure).
    @param n_ubatch: The micro-batch (C{-ub}); embedding and rerank
        children use their per-slot context.
    """
    n_embd = meta.embedding_length or 0
    n_ff = meta.feed_forward_length or 4 * n_embd
    n_head = meta.head_count_max or meta.head_count or 1
    stream = _pad(max(ctx_per_slot, 1))
    n_tokens = min(n_ubatch, stream)
    attention = stream // 2 if flash_attn else stream * (n_head + 1)
    return 4 * n_tokens * (5 * n_embd + 3 * n_ff + attention)


@attrs.frozen
class ModelNeed:
    """
    What one model needs, unit by unit (L{estimate_need}).

    @ivar name: The model, for messages.
    @ivar layer_weights: Weight bytes of each block.
    @ivar layer_kv: KV cache bytes of each block.
    @ivar output: Bytes of the output layer (on its device: the last GPU
        when it is offloaded).
    @ivar input: Bytes that always stay on the CPU (the token embedding).
    @ivar compute: The compute buffer of each device that holds layers.
    @ivar logits: What the device of the output layer holds on top of
        it: one f32 row of logits per slot.
    @ivar overhead: Bytes per GPU that llama.cpp does not report
        (L{DEVICE_OVERHEAD}).
    @ivar measured: The correction from the last measurement
        (L{correction}): bytes, positive when the child used more.
    @ivar ctx_size: Tokens per slot the estimate is for (for messages).
    @ivar parallel: Slots.
    @ivar cache_type_k: The KV cache's K type.
    @ivar cache_type_v: The KV cache's V type.
    @ivar draft: Bytes of a draft model (C{speculative = "draft"}): its
        weights, KV cache and compute buffer at the same slots
        (L{draft_bytes}); counted whole on each GPU that holds units
        (llama-server places the draft on the child's GPUs, C{--spec-draft-ngl
        all}), or in RAM when none does.
    """

    name: str
    layer_weights: tuple[int, ...]
    layer_kv: tuple[int, ...]
    output: int
    input: int
    compute: int
    logits: int = 0
    overhead: int = DEVICE_OVERHEAD
    measured: int = 0
    ctx_size: int = 0
    parallel: int = 1
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    draft: int = 0

    @property
    def n_units(self) -> int:
        """
        C{n_layer + 1}: the blocks and the output layer, the most C{-ngl}
        can offload.
        """
        return len(self.layer_weights) + 1

    def units(self) -> list[int]:
        """
        Bytes of each unit in llama.cpp's order: each block's weights and
        KV cache, then the output layer.
        """
        return [w + kv for w, kv in zip(self.layer_weights, self.layer_kv)] + [self.output]

    @property
    def weights(self) -> int:
        return sum(self.layer_weights) + self.output + self.input

    @property
    def kv(self) -> int:
        return sum(self.layer_kv)

    @property
    def total(self) -> int:
        """
        Bytes on one GPU with every layer there: the plan's figure for a
        single-GPU placement, without the correction.
        """
        return sum(self.units()) + self.compute + self.logits + self.overhead + self.draft


def draft_bytes(need: ModelNeed) -> int:
    """
    What a draft model adds to its target's child: its L{estimate_need}
    less the per-GPU overhead the target already counts, with its input
    layer (held where the draft runs).
    """
    return sum(need.units()) + need.compute + need.logits + need.input


def estimate_need(
    name: str,
    meta: GGUFMetadata,
    ctx_per_slot: int,
    parallel: int,
    *,
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    flash_attn: bool = False,
    n_ubatch: int = DEFAULT_UBATCH,
    measured: int = 0,
    overhead: int = DEVICE_OVERHEAD,
) -> ModelNeed:
    """
    What a child for C{meta}'s model needs at C{ctx_per_slot} tokens for
    each of C{parallel} slots (the module's docstring gives the formula).

    A file without per-layer tensor sizes (a L{GGUFMetadata} built by hand)
    counts its whole C{size} as blocks of equal size.

    @param cache_type_k: C{-ctk}: a key of L{CACHE_TYPE_BYTES}.
    @param cache_type_v: C{-ctv}.
    @param flash_attn: See L{compute_bytes}.
    @param measured: The model's last L{correction}, or 0.
    @raise ValueError: An unknown cache type.
    """
    n_layer = meta.block_count or len(meta.layer_bytes)
    if meta.layer_bytes:
        weights = tuple(meta.layer_bytes) + (0,) * (n_layer - len(meta.layer_bytes))
        output, input_ = meta.output_bytes, meta.input_bytes
    else:
        each = meta.size // (n_layer + 1) if n_layer else 0
        weights, output, input_ = (each,) * n_layer, meta.size - each * n_layer, 0
    head_count = meta.head_count or 1
    head_dim = (meta.embedding_length or 0) // head_count
    k_len = meta.key_length or head_dim
    v_len = meta.value_length or k_len
    heads_kv = meta.head_counts_kv or (meta.head_count_kv or head_count,) * n_layer
    parallel = max(parallel, 1)
    stream = _pad(_pad(max(ctx_per_slot, 1) * parallel) // parallel)
    swa_stream = _pad(min(stream, (meta.sliding_window or 0) + n_ubatch))
    kv = []
    for i in range(n_layer):
        n_kv = heads_kv[i] if i < len(heads_kv) else heads_kv[-1] if heads_kv else 0
        swa = i < len(meta.swa_layers) and meta.swa_layers[i]
        cells = parallel * (swa_stream if swa else stream)
        kv.append(cells * (kv_bytes(n_kv * k_len, cache_type_k) + kv_bytes(n_kv * v_len, cache_type_v)))
    return ModelNeed(
        name=name,
        layer_weights=weights[:n_layer],
        layer_kv=tuple(kv),
        output=output,
        input=input_,
        compute=compute_bytes(meta, ctx_per_slot, flash_attn, n_ubatch),
        logits=4 * parallel * (meta.vocab_size or 0),
        overhead=overhead,
        measured=measured,
        ctx_size=ctx_per_slot,
        parallel=parallel,
        cache_type_k=cache_type_k,
        cache_type_v=cache_type_v,
    )


def correction(planned: Mapping[int, int], measured: Mapping[int, int]) -> int:
    """
    The figure to keep for a model after its child started: what NVML
    measured for the child's process on each GPU, minus what its L{Plan}
    expected (L{Plan.gpu_bytes}, which already holds the previous
    correction), added to that previous correction by the caller:
    C{need.measured + correction(plan.gpu_bytes, measured)}.

    @param planned: GPU index to planned bytes.
    @param measured: GPU index to the bytes NVML reports for the child.
    """
    return sum(measured.values()) - sum(planned.values())


@attrs.frozen
class GPUFree:
    """
    One GPU as the planner sees it. From a hardware probe's C{GPU}:
    C{GPUFree(gpu.index, gpu.free)}.

    @ivar index: NVML's index (the child must see the same device: start
        it with C{CUDA_DEVICE_ORDER=PCI_BUS_ID}).
    @ivar free: Bytes free now.
    """

    index: int
    free: int


@attrs.frozen
class Loaded:
    """
    A loaded model, a candidate for eviction.

    @ivar name: The model, as the plan's C{evictions} name it.
    @ivar held: GPU index to the bytes its child holds there.
    @ivar ram: Bytes of RAM its child holds (its CPU layers), freed too.
    @ivar last_used: When it last served a request (any clock, same for
        all): the least recently used goes first.
    @ivar pinned: Its C{keep_alive} is negative (C{-1}, forever): evicted
        only after every unpinned one.
    @ivar busy: It has requests running: never evicted.
    """

    name: str
    held: Mapping[int, int] = attrs.field(factory=dict)
    ram: int = 0
    last_used: float = 0.0
    pinned: bool = False
    busy: bool = False


@attrs.frozen
class Wishes:
    """
    What the model's config (C{[models."x"]}) or the request's options
    (Ollama's C{num_gpu}, C{main_gpu}) ask; L{None} and empty leave it to
    the planner.

    @ivar gpu_layers: Units to offload (C{-ngl}); more than the model has
        means all. Honoured as given: a model that does not fit with it is
        refused, not given fewer.
    @ivar main_gpu: The one GPU for the model: no split; what does not
        fit on it stays on the CPU.
    @ivar tensor_split: Shares per allowed GPU, in index order
        (C{--tensor-split}); zero leaves a GPU out.
    @ivar devices: The GPU indices the model may use; L{None} for all,
        empty for none (a CPU plan).
    """

    gpu_layers: int | None = None
    main_gpu: int | None = None
    tensor_split: tuple[float, ...] = ()
    devices: tuple[int, ...] | None = None


@attrs.frozen
class Plan:
    """
    Where a model goes.

    @ivar devices: The GPUs it uses, in the child's device order: start it
        seeing exactly these (C{CUDA_VISIBLE_DEVICES} or C{--device}); empty
        for a CPU-only child (C{-ngl 0}).
    @ivar tensor_split: With more than one device, each one's share, in
        C{devices} order (C{--tensor-split}): the number of units it
        holds, which makes llama.cpp's split exactly the planned one.
    @ivar gpu_layers: C{-ngl}: units on the GPUs, the output layer first
        (C{n_layer + 1} is all of them).
    @ivar evictions: Models to stop first, in order.
    @ivar gpu_bytes: GPU index to the bytes the child is expected to hold
        there (what L{correction} compares with NVML's figure).
    @ivar ram_bytes: Bytes expected in RAM (the input layer, the CPU
        layers with their KV cache and the CPU's compute buffer).
    @ivar n_units: C{n_layer + 1}, so C{gpu_layers < n_units} is a partial
        offload.
    """

    devices: tuple[int, ...]
    tensor_split: tuple[float, ...]
    gpu_layers: int
    evictions: tuple[str, ...]
    gpu_bytes: Mapping[int, int]
    ram_bytes: int
    n_units: int

    @property
    def full(self) -> bool:
        """
        Whether every layer is on the GPU(s).
        """
        return bool(self.devices) and self.gpu_layers >= self.n_units

    @property
    def main_gpu(self) -> int | None:
        """
        The GPU of a single-GPU plan, else L{None}.
        """
        return self.devices[0] if len(self.devices) == 1 else None


@attrs.frozen
class NoFit:
    """
    The model cannot be placed: a refusal (HTTP 503) whose message names
    what to change.

    @ivar message: For the client and the log.
    @ivar levers: The config keys and actions the message names
        (C{"ctx_size"}, C{"parallel"}, C{"cache_type_k"}, C{"cache_type_v"},
        C{"gpu_layers"}, C{"main_gpu"}, C{"devices"}, C{"unload"},
        C{"quantization"}).
    @ivar unload: The loaded models the message suggests unloading: every
        one but the model itself (busy ones, which the planner never
        evicts, and idle ones whose eviction was not enough).
    """

    message: str
    levers: tuple[str, ...]
    unload: tuple[str, ...] = ()


def _fmt(n: int) -> str:
    if abs(n) >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / MiB:.0f} MiB"


@attrs.frozen
class _Layout:
    devices: tuple[int, ...]
    counts: tuple[int, ...]
    gpu_bytes: Mapping[int, int]


@functools.lru_cache(maxsize=16)
def _prefix(need: ModelNeed) -> tuple[int, ...]:
    """
    Running totals of L{ModelNeed.units}: units C{a .. b - 1} hold
    C{prefix[b] - prefix[a]} bytes.
    """
    return (0, *itertools.accumulate(need.units()))


def _one_device(need: ModelNeed, k: int, first: int, count: int, is_first: bool) -> int:
    """
    Bytes on one device holding units C{first .. first + count - 1} when
    the last C{k} units are on the GPUs (without the correction).
    """
    prefix = _prefix(need)
    end = first + count
    total = prefix[end] - prefix[first] + need.compute + need.overhead + need.draft
    if end == need.n_units:  # it holds the output layer
        total += need.logits
    start = need.n_units - k
    if is_first and start > 0:
        # llama.cpp copies a CPU layer's weights to the first GPU to run a
        # large batch there (the scheduler's op offload): room for the
        # largest of them
        total += max(need.layer_weights[:start], default=0)
    return total


def _device_bytes(need: ModelNeed, k: int, devices: Sequence[int], counts: Sequence[int]) -> dict[int, int]:
    """
    Bytes on each device when the last C{k} units sit on C{devices},
    C{counts[i]} consecutive units on the C{i}-th, with the correction
    spread in proportion.
    """
    out: dict[int, int] = {}
    first = need.n_units - k
    for d, (device, count) in enumerate(zip(devices, counts)):
        out[device] = _one_device(need, k, first, count, d == 0)
        first += count
    planned = sum(out.values())
    if need.measured and planned:
        out = {d: max(b + need.measured * b // planned, 0) for d, b in out.items()}
    return out


def _ram_bytes(need: ModelNeed, k: int) -> int:
    """
    RAM for the CPU's part: the input layer, the units not on a GPU and,
    with any, the CPU's compute buffer (with none, the host's staging
    buffer is a few MiB, left out).
    """
    units = need.units()[: need.n_units - k]
    host_compute = need.compute if units else 0
    return need.input + sum(units) + host_compute + (need.logits + need.draft if k == 0 else 0)


def _fits(sizes: Mapping[int, int], room: Mapping[int, int]) -> bool:
    return all(size <= room.get(d, 0) for d, size in sizes.items())


def _split_counts(shares: Sequence[float], k: int) -> list[int]:
    """
    llama.cpp's layer split: unit C{j} of C{k} goes to the first device
    whose cumulative normalised share exceeds C{j / k}.
    """
    total = sum(shares)
    cumulative, acc = [], 0.0
    for share in shares:
        acc += share
        cumulative.append(acc / total)
    counts = [0] * len(shares)
    for j in range(k):
        d = next((i for i, c in enumerate(cumulative) if c > j / k), len(shares) - 1)
        counts[d] += 1
    return counts


def _proportional_counts(units: Sequence[int], rooms: Sequence[int]) -> list[int]:
    """
    Consecutive units per device, each device's part of the bytes in
    proportion to its room: a unit goes to the device whose cumulative
    target its middle falls under.
    """
    total_room = sum(rooms)
    total = sum(units)
    bounds, acc = [], 0
    for room in rooms:
        acc += room
        bounds.append(total * acc / total_room)
    counts = [0] * len(rooms)
    done = 0.0
    d = 0
    for size in units:
        middle = done + size / 2
        while d < len(rooms) - 1 and middle > bounds[d]:
            d += 1
        counts[d] += 1
        done += size
    return counts


def _greedy_counts(need: ModelNeed, k: int, devices: Sequence[int], room: Mapping[int, int]) -> list[int] | None:
    """
    Fill each device in order with as many units as it holds (the packing
    that fits whenever any split into consecutive runs does), or L{None}.
    """
    counts = [0] * len(devices)
    first = need.n_units - k
    placed = 0
    for d, device in enumerate(devices):
        while placed < k and _one_device(need, k, first, counts[d] + 1, d == 0) <= room[device]:
            counts[d] += 1
            placed += 1
        first += counts[d]
    return counts if placed == k else None


def _layout(need: ModelNeed, k: int, room: Mapping[int, int], wishes: Wishes) -> _Layout | None:
    """
    Where C{k} units go on the GPUs in C{room} (index to bytes the model
    may use), or L{None} if they do not fit: the user's split or GPU, else
    the single GPU with the most room that holds them, else the fewest
    GPUs (those with the most room) sharing them in proportion to room.
    """

    def single(device: int) -> _Layout | None:
        sizes = _device_bytes(need, k, [device], [k])
        return _Layout((device,), (k,), sizes) if _fits(sizes, room) else None

    def on(devices: Sequence[int], counts: Sequence[int]) -> _Layout | None:
        used = [(d, c) for d, c in zip(devices, counts) if c]
        if not used:
            return None
        ds, cs = [d for d, _ in used], [c for _, c in used]
        sizes = _device_bytes(need, k, ds, cs)
        return _Layout(tuple(ds), tuple(cs), sizes) if _fits(sizes, room) else None

    if wishes.tensor_split:
        ordered = sorted(room)
        shares = list(wishes.tensor_split[: len(ordered)])
        pairs = [(d, s) for d, s in zip(ordered, shares) if s > 0]
        if not pairs:
            return None
        counts = _split_counts([s for _, s in pairs], k)
        return on([d for d, _ in pairs], counts)
    if wishes.main_gpu is not None:
        return single(wishes.main_gpu) if wishes.main_gpu in room else None
    by_room = sorted(room, key=lambda d: (-room[d], d))
    for device in by_room:
        layout = single(device)
        if layout is not None:
            return layout
    units = need.units()[need.n_units - k :]
    for m in range(2, len(by_room) + 1):
        chosen = sorted(by_room[:m])
        fixed = need.compute + need.overhead
        rooms = [max(room[d] - fixed, 0) for d in chosen]
        if not all(rooms):
            continue
        layout = on(chosen, _proportional_counts(units, rooms))
        if layout is None:
            greedy = _greedy_counts(need, k, chosen, room)
            layout = on(chosen, greedy) if greedy is not None else None
        if layout is not None:
            return layout
    return None


def _plan(need: ModelNeed, k: int, layout: _Layout | None, evictions: Sequence[str]) -> Plan:
    if layout is None or k == 0:
        return Plan((), (), 0, tuple(evictions), {}, _ram_bytes(need, 0), need.n_units)
    split = tuple(float(c) for c in layout.counts) if len(layout.devices) > 1 else ()
    return Plan(layout.devices, split, k, tuple(evictions), dict(layout.gpu_bytes), _ram_bytes(need, k), need.n_units)


# one try at a placement: (room per GPU, RAM free, evictions) -> a plan or None
_Attempt = Callable[[Mapping[int, int], "int | None", Sequence[str]], "Plan | None"]


def eviction_order(loaded: Iterable[Loaded]) -> list[Loaded]:
    """
    The models the planner may evict, in the order it would: idle
    unpinned ones least recently used first, then idle pinned ones the
    same way; busy ones never.
    """
    return sorted((m for m in loaded if not m.busy), key=lambda m: (m.pinned, m.last_used, m.name))


def place(
    need: ModelNeed,
    gpus: Sequence[GPUFree],
    *,
    reserve: int = 0,
    loaded: Sequence[Loaded] = (),
    ram_free: int | None = None,
    wishes: Wishes = Wishes(),
) -> Plan | NoFit:
    """
    Where C{need}'s model goes.

    Policy, in order:
      1. No GPU (none, none allowed by C{wishes.devices} that exists,
         or C{gpu_layers} 0): a CPU plan, checked against C{ram_free};
         if RAM is short, idle models are evicted (the order of
         L{eviction_order}, by their C{ram}) when that makes it fit.
      2. Every layer asked for (all, or C{wishes.gpu_layers}) on the GPUs
         as they are: the user's C{tensor_split} or C{main_gpu} if given,
         else the one GPU with the most room that holds it, else the
         fewest GPUs with the most room, split in proportion to room.
      3. The same after evicting idle models in L{eviction_order}, one
         more at a time until it fits; then those whose eviction turns
         out not to be needed are kept (the most recently used first).
         Eviction is only ever for a model to fit entirely where it was
         asked to go: never to offload a few more layers.
      4. Without an explicit C{gpu_layers}: as many units as fit on the
         GPUs as they are (no eviction), the rest on the CPU, if the RAM
         holds it; when no GPU holds a single unit, the CPU plan of
         step 1 (without evictions).
      5. Else L{NoFit}.

    @param gpus: What each GPU has free now (NVML), not counting what
        the evicted models would free: that comes from C{loaded}.
    @param reserve: Bytes to leave free on each GPU.
    @param loaded: The models loaded now (any GPU), candidates for
        eviction. A model being reloaded with another placement is one
        of them (its own name).
    @param ram_free: Bytes of RAM available to the CPU part, or L{None}
        not to check it.
    """
    n_units = need.n_units
    indices = [g.index for g in gpus]
    allowed = [g for g in gpus if wishes.devices is None or g.index in wishes.devices]
    if wishes.devices is not None and wishes.devices and not allowed:
        return _no_fit(
            need,
            f"the GPUs it may use ({', '.join(map(str, wishes.devices))}) are not on this "
            f"machine (it has {_gpu_list(indices)})",
            ("devices",),
        )
    if wishes.main_gpu is not None and not wishes.tensor_split and wishes.main_gpu not in [g.index for g in allowed]:
        return _no_fit(
            need,
            f"main_gpu = {wishes.main_gpu} names no GPU it may use (this machine has "
            f"{_gpu_list([g.index for g in allowed])})",
            ("main_gpu",),
        )
    want = n_units if wishes.gpu_layers is None else min(max(wishes.gpu_layers, 0), n_units)
    order = eviction_order(loaded)
    if not allowed or want == 0:
        return _cpu_plan(need, ram_free, order)
    room = {g.index: g.free - reserve for g in allowed}

    def whole(room: Mapping[int, int], ram: int | None, evictions: Sequence[str]) -> Plan | None:
        layout = _layout(need, want, room, wishes)
        if layout is None or (ram is not None and _ram_bytes(need, want) > ram):
            return None
        return _plan(need, want, layout, evictions)

    plan = whole(room, ram_free, ())
    if plan is not None:
        return plan
    plan = _with_evictions(order, room, ram_free, whole)
    if plan is not None:
        return plan
    if wishes.gpu_layers is None:
        for k in range(want - 1, 0, -1):
            layout = _layout(need, k, room, wishes)
            if layout is None:
                continue
            if ram_free is not None and _ram_bytes(need, k) > ram_free:
                return _no_fit(
                    need,
                    f"with {k} of its {n_units} layers on {_gpu_names(layout.devices)} the rest "
                    f"needs {_fmt(_ram_bytes(need, k))} of RAM and {_fmt(ram_free)} is free",
                    ("ctx_size", "parallel", "cache_type_k", "cache_type_v", "unload", "quantization"),
                    loaded,
                )
            return _plan(need, k, layout, ())
        cpu = _cpu_plan(need, ram_free, (), where=f"no layer fits on {_gpu_names(list(room))}")
        if isinstance(cpu, Plan):
            return cpu
    best = max(allowed, key=lambda g: g.free)
    asked = (
        ""
        if wishes.gpu_layers is None
        else f" with gpu_layers = {wishes.gpu_layers}"
        if want < n_units
        else " with every layer on the GPU"
    )
    needed = _one_device(need, want, n_units - want, want, True) + need.measured
    where = (
        f"it needs {_fmt(needed)} on one GPU{asked} ({_parts(need)}), and the most free is "
        f"{_fmt(best.free)} on GPU {best.index}"
        + (f" ({_fmt(reserve)} of it kept free by gpu_reserve_bytes)" if reserve else "")
    )
    if ram_free is not None and wishes.gpu_layers is None:
        where += f", with {_fmt(ram_free)} of RAM free for layers left on the CPU"
    # without an explicit gpu_layers every count was tried: it is no lever
    levers = (
        ("ctx_size", "parallel", "cache_type_k", "cache_type_v")
        + (("gpu_layers",) if wishes.gpu_layers is not None else ())
        + ("unload", "quantization")
    )
    return _no_fit(need, where, levers, loaded)


def _with_evictions(
    order: Sequence[Loaded], room: Mapping[int, int], ram: int | None, attempt: _Attempt
) -> Plan | None:
    """
    Evict C{order}'s models one more at a time until C{attempt} fits,
    then keep back the ones not needed, the most recently used first.
    """
    useful = [m for m in order if any(m.held.get(d, 0) > 0 for d in room) or (ram is not None and m.ram > 0)]
    chosen: list[Loaded] = []
    for model in useful:
        chosen.append(model)
        if _try(chosen, room, ram, attempt) is None:
            continue
        for candidate in reversed(list(chosen)):
            rest = [m for m in chosen if m is not candidate]
            if _try(rest, room, ram, attempt) is not None:
                chosen = rest
        return _try(chosen, room, ram, attempt)
    return None


def _try(evicted: Sequence[Loaded], room: Mapping[int, int], ram: int | None, attempt: _Attempt) -> Plan | None:
    freed = dict(room)
    for model in evicted:
        for device, held in model.held.items():
            if device in freed:
                freed[device] += held
    more_ram = None if ram is None else ram + sum(m.ram for m in evicted)
    return attempt(freed, more_ram, [m.name for m in evicted])


def _cpu_plan(need: ModelNeed, ram_free: int | None, order: Sequence[Loaded], where: str = "") -> Plan | NoFit:
    """
    The CPU-only plan, evicting idle models for RAM if that makes it fit.
    """
    ram = _ram_bytes(need, 0)

    def attempt(room: Mapping[int, int], free: int | None, evictions: Sequence[str]) -> Plan | None:
        return _plan(need, 0, None, evictions) if free is None or ram <= free else None

    plan = attempt({}, ram_free, ()) or _with_evictions(order, {}, ram_free, attempt)
    if plan is not None:
        return plan
    prefix = f"{where}; on the CPU " if where else "on the CPU "
    return _no_fit(
        need,
        f"{prefix}it needs {_fmt(ram)} of RAM ({_parts(need)}) and {_fmt(ram_free or 0)} is free",
        ("ctx_size", "parallel", "cache_type_k", "cache_type_v", "unload", "quantization"),
        order,
    )


def _parts(need: ModelNeed) -> str:
    return (
        f"{_fmt(need.weights)} of weights, {_fmt(need.kv)} of KV cache for ctx_size {need.ctx_size} x "
        f"parallel {need.parallel} at {need.cache_type_k}/{need.cache_type_v}, {_fmt(need.compute)} of "
        f"compute buffer" + (f", {_fmt(need.draft)} for the draft model" if need.draft else "")
    )


def _gpu_list(indices: Sequence[int]) -> str:
    return "GPUs " + ", ".join(map(str, sorted(indices))) if indices else "no GPU"


def _gpu_names(indices: Sequence[int]) -> str:
    return ("GPU " if len(indices) == 1 else "GPUs ") + ", ".join(map(str, sorted(indices)))


def _no_fit(need: ModelNeed, why: str, levers: tuple[str, ...], loaded: Sequence[Loaded] = ()) -> NoFit:
    """
    The refusal: why, then each lever in L{NoFit.levers} as something to
    do, naming the config keys of C{[models."name"]}.
    """
    table = f'[models."{need.name}"]'
    advice = []
    if "devices" in levers:
        advice.append("list GPUs this machine has")
    if "main_gpu" in levers:
        advice.append(f"set main_gpu in {table} to one of them, or remove it")
    if "ctx_size" in levers:
        advice.append(f"lower ctx_size (now {need.ctx_size}) or parallel (now {need.parallel}) in {table}")
    if "cache_type_k" in levers and need.cache_type_k == need.cache_type_v == "f16":
        advice.append(
            'set cache_type_k and cache_type_v = "q8_0" (about half the KV cache) or "q4_0" (about a quarter)'
        )
    elif "cache_type_k" in levers:
        advice.append('set cache_type_k and cache_type_v to a smaller type ("q4_0")')
    if "gpu_layers" in levers:
        advice.append(f"set gpu_layers lower in {table} to keep more layers on the CPU")
    names = [m.name for m in loaded if m.name != need.name]
    if "unload" in levers and names:
        advice.append("unload another model (blazar evict " + " | ".join(names) + ")")
    if "quantization" in levers:
        advice.append("use a smaller quantization of the model (Q4_K_M, Q3_K_M)")
    message = f"{need.name} does not fit: {why}. To fit it, " + "; or ".join(advice) + "."
    return NoFit(
        message, levers if names or "unload" not in levers else tuple(x for x in levers if x != "unload"), tuple(names)
    )
