"""
The placement planner (L{blazar.engines.planner}): the estimate from GGUF
facts, and the policy as tables of machines, wishes and loaded models
against the plan or the refusal they give.

Most policy tests use a round model (L{need}): ten blocks of 100 MiB of
weights and 10 MiB of KV cache, a 50 MiB output layer, 20 MiB of input
layer, a 100 MiB compute buffer and no per-GPU overhead: 1250 MiB on one
GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from blazar.engines.planner import (
    DEFAULT_UBATCH,
    DEVICE_OVERHEAD,
    GiB,
    GPUFree,
    Loaded,
    MiB,
    ModelNeed,
    NoFit,
    Plan,
    Wishes,
    _split_counts,
    compute_bytes,
    correction,
    estimate_need,
    eviction_order,
    place,
)
from blazar.models.gguf_meta import GGUFMetadata, thd_read_metadata
from blazar.models.testmodel import make_test_model


def need(measured: int = 0, **kw: Any) -> ModelNeed:
    values: dict[str, Any] = dict(
        name="m",
        layer_weights=(100 * MiB,) * 10,
        layer_kv=(10 * MiB,) * 10,
        output=50 * MiB,
        input=20 * MiB,
        compute=100 * MiB,
        overhead=0,
        measured=measured,
        ctx_size=4096,
        parallel=4,
    )
    values.update(kw)
    return ModelNeed(**values)


def gpu(index: int, free_mib: int) -> GPUFree:
    return GPUFree(index, free_mib * MiB)


def summary(result: Plan | NoFit) -> tuple[Any, ...]:
    assert isinstance(result, Plan), result
    return result.devices, result.tensor_split, result.gpu_layers, result.evictions


def refused(test: SynchronousTestCase, result: Plan | NoFit) -> NoFit:
    test.assertIsInstance(result, NoFit)
    assert isinstance(result, NoFit)
    return result


class PlacementTests(SynchronousTestCase):
    def test_placements(self) -> None:
        """
        One GPU that holds it all wins (the most free, or main_gpu); a
        model too big for any one GPU is split in proportion to room
        (tensor_split: units per GPU); else as many units as fit go on the
        GPU and the rest on the CPU; the user's gpu_layers, main_gpu,
        tensor_split and devices are honoured; no GPU is a CPU plan.
        """
        cases: list[tuple[str, list[GPUFree], Wishes, tuple[Any, ...]]] = [
            ("one GPU fits", [gpu(0, 2048)], Wishes(), ((0,), (), 11, ())),
            ("the most free", [gpu(0, 1500), gpu(1, 2048)], Wishes(), ((1,), (), 11, ())),
            ("main_gpu", [gpu(0, 1500), gpu(1, 2048)], Wishes(main_gpu=0), ((0,), (), 11, ())),
            # 800 MiB: compute 100, room for the largest CPU layer's weights
            # (op offload) 100, the output layer 50 and 5 blocks of 110
            ("too small: partial", [gpu(0, 800)], Wishes(), ((0,), (), 6, ())),
            (
                "main_gpu too small: partial there, no split",
                [gpu(0, 800), gpu(1, 800)],
                Wishes(main_gpu=0),
                ((0,), (), 6, ()),
            ),
            ("split evenly", [gpu(0, 800), gpu(1, 800)], Wishes(), ((0, 1), (5.0, 6.0), 11, ())),
            ("split by room", [gpu(0, 600), gpu(1, 1100)], Wishes(), ((0, 1), (3.0, 8.0), 11, ())),
            ("the fewest GPUs", [gpu(0, 100), gpu(1, 800), gpu(2, 800)], Wishes(), ((1, 2), (5.0, 6.0), 11, ())),
            (
                "tensor_split as llama.cpp splits",
                [gpu(0, 2048), gpu(1, 2048)],
                Wishes(tensor_split=(1.0, 1.0)),
                ((0, 1), (6.0, 5.0), 11, ()),
            ),
            (
                "tensor_split leaving a GPU out",
                [gpu(0, 2048), gpu(1, 2048)],
                Wishes(tensor_split=(0.0, 1.0)),
                ((1,), (), 11, ()),
            ),
            ("gpu_layers", [gpu(0, 2048)], Wishes(gpu_layers=4), ((0,), (), 4, ())),
            ("gpu_layers above the model's", [gpu(0, 2048)], Wishes(gpu_layers=99), ((0,), (), 11, ())),
            ("gpu_layers 0", [gpu(0, 2048)], Wishes(gpu_layers=0), ((), (), 0, ())),
            ("allowed devices", [gpu(0, 4096), gpu(1, 2048)], Wishes(devices=(1,)), ((1,), (), 11, ())),
            ("no GPU", [], Wishes(), ((), (), 0, ())),
            ("no GPU holds a unit: CPU", [gpu(0, 150)], Wishes(), ((), (), 0, ())),
        ]
        for label, gpus, wishes, expected in cases:
            result = place(need(), gpus, wishes=wishes, ram_free=8 * GiB)
            self.assertEqual(summary(result), expected, label)
            assert isinstance(result, Plan)
            for index, used in result.gpu_bytes.items():
                self.assertLessEqual(used, next(g.free for g in gpus if g.index == index), label)

    def test_bytes(self) -> None:
        """
        The plan's bytes per GPU and in RAM: units, compute buffer and
        overhead on each GPU (logits with the output layer); the input
        layer, the CPU units and the CPU's compute buffer in RAM.
        """
        cases: list[tuple[list[GPUFree], ModelNeed, dict[int, int], int]] = [
            ([gpu(0, 2048)], need(), {0: 1250 * MiB}, 20 * MiB),
            ([gpu(0, 2048)], need(overhead=300 * MiB, logits=1 * MiB), {0: 1551 * MiB}, 20 * MiB),
            ([gpu(0, 800), gpu(1, 800)], need(), {0: 650 * MiB, 1: 700 * MiB}, 20 * MiB),
            # 5 blocks on the CPU with the CPU's compute buffer
            ([gpu(0, 800)], need(), {0: 800 * MiB}, (20 + 550 + 100) * MiB),
            ([], need(logits=1 * MiB), {}, (20 + 1150 + 100 + 1) * MiB),
            # a draft model: whole on each GPU that holds units, in RAM when none does
            ([gpu(0, 2048)], need(draft=200 * MiB), {0: 1450 * MiB}, 20 * MiB),
            ([gpu(0, 800), gpu(1, 900)], need(draft=100 * MiB), {0: 750 * MiB, 1: 800 * MiB}, 20 * MiB),
            ([], need(draft=200 * MiB), {}, (20 + 1150 + 100 + 200) * MiB),
        ]
        for gpus, model, gpu_bytes, ram in cases:
            result = place(model, gpus)
            assert isinstance(result, Plan), result
            self.assertEqual((dict(result.gpu_bytes), result.ram_bytes), (gpu_bytes, ram))

    def test_a_draft_model_takes_room(self) -> None:
        """
        A model that fits whole alone gets fewer layers on the GPU with a
        draft model beside it, and the refusal names the draft's bytes.
        """
        self.assertEqual(summary(place(need(), [gpu(0, 1300)]))[2], 11)
        # 1300 - 300 draft - 100 compute - 100 (a CPU layer copied for big batches) = 800: output + 6 blocks
        self.assertEqual(summary(place(need(draft=300 * MiB), [gpu(0, 1300)]))[2], 7)
        short = refused(self, place(need(draft=300 * MiB), [], ram_free=1000 * MiB))
        self.assertIn("300 MiB for the draft model", short.message)

    def test_reserve(self) -> None:
        """
        The reserve is left free on every GPU.
        """
        self.assertEqual(summary(place(need(), [gpu(0, 1300)])), ((0,), (), 11, ()))
        self.assertEqual(summary(place(need(), [gpu(0, 1300)], reserve=100 * MiB))[2], 9)

    def test_ram(self) -> None:
        """
        The CPU's part must fit in the free RAM; L{None} does not check.
        """
        self.assertEqual(summary(place(need(), [gpu(0, 800)], ram_free=None))[2], 6)
        self.assertEqual(summary(place(need(), [gpu(0, 800)], ram_free=670 * MiB))[2], 6)
        short = refused(self, place(need(), [gpu(0, 800)], ram_free=669 * MiB))
        self.assertIn(
            "with 6 of its 11 layers on GPU 0 the rest needs 670 MiB of RAM and 669 MiB is free", short.message
        )

    def test_split_matches_llamacpp(self) -> None:
        """
        A plan's tensor split is each GPU's unit count, which llama.cpp's
        own split (unit j to the first device whose cumulative share
        exceeds j/k) turns back into the same counts.
        """
        for counts in [(5, 6), (3, 8), (1, 1, 1), (7, 0, 4), (10, 21, 2, 1), (1, 40)]:
            self.assertEqual(_split_counts([float(c) for c in counts], sum(counts)), list(counts))

    def test_measured_correction(self) -> None:
        """
        The last measurement's difference is added to the next plan,
        spread over its GPUs in proportion, and decides what fits.
        """
        self.assertEqual(correction({0: 1000}, {0: 1200}), 200)
        self.assertEqual(correction({0: 600, 1: 600}, {0: 500, 1: 600}), -100)
        fits = place(need(), [gpu(0, 1300)])
        self.assertEqual(summary(fits)[2], 11)
        more = place(need(measured=200 * MiB), [gpu(0, 1300)])
        self.assertLess(summary(more)[2], 11)
        less = place(need(measured=-100 * MiB), [gpu(0, 1200)])
        assert isinstance(less, Plan)
        self.assertEqual((less.gpu_layers, dict(less.gpu_bytes)), (11, {0: 1150 * MiB}))
        split = place(need(measured=135 * MiB), [gpu(0, 800), gpu(1, 800)])
        assert isinstance(split, Plan)
        self.assertEqual(dict(split.gpu_bytes), {0: 715 * MiB, 1: 770 * MiB})


class EvictionTests(SynchronousTestCase):
    """
    With 800 MiB free, the 1250 MiB model fits whole only after freeing
    at least 450 MiB on its GPU.
    """

    def test_evictions(self) -> None:
        """
        Idle models are evicted least recently used first, pinned ones
        after every unpinned one, busy ones never; only what is needed
        (a model whose eviction turns out not to help is kept), and only
        to make the model fit whole: otherwise a partial offload with no
        eviction.
        """
        a = Loaded("a", {0: 300 * MiB}, last_used=5)
        b = Loaded("b", {0: 300 * MiB}, last_used=1)
        small = Loaded("small", {0: 100 * MiB}, last_used=0)
        pinned = Loaded("pinned", {0: 1000 * MiB}, last_used=0, pinned=True)
        busy = Loaded("busy", {0: 2000 * MiB}, last_used=0, busy=True)
        elsewhere = Loaded("elsewhere", {1: 4000 * MiB}, last_used=0)
        cases: list[tuple[str, list[GPUFree], list[Loaded], Wishes, tuple[Any, ...]]] = [
            ("LRU", [gpu(0, 800)], [a, b], Wishes(), ((0,), (), 11, ("b", "a"))),
            ("pinned last", [gpu(0, 800)], [pinned, a, b], Wishes(), ((0,), (), 11, ("b", "a"))),
            (
                "pinned when needed, and only what is needed",
                [gpu(0, 800)],
                [small, pinned],
                Wishes(),
                ((0,), (), 11, ("pinned",)),
            ),
            ("busy never", [gpu(0, 800)], [busy], Wishes(), ((0,), (), 6, ())),
            ("not for a partial offload", [gpu(0, 500)], [a], Wishes(), ((0,), (), 3, ())),
            (
                "not from a GPU it may not use",
                [gpu(0, 800), gpu(1, 100)],
                [elsewhere],
                Wishes(devices=(0,)),
                ((0,), (), 6, ()),
            ),
            (
                "from another GPU when that one then holds it",
                [gpu(0, 800), gpu(1, 100)],
                [elsewhere],
                Wishes(),
                ((1,), (), 11, ("elsewhere",)),
            ),
            (
                "for an explicit gpu_layers",
                [gpu(0, 800)],
                [Loaded("c", {0: 500 * MiB})],
                Wishes(gpu_layers=11),
                ((0,), (), 11, ("c",)),
            ),
            ("nothing to evict when it fits", [gpu(0, 2048)], [a, b], Wishes(), ((0,), (), 11, ())),
        ]
        for label, gpus, loaded, wishes, expected in cases:
            self.assertEqual(summary(place(need(), gpus, loaded=loaded, wishes=wishes)), expected, label)

    def test_order(self) -> None:
        loaded = [
            Loaded("p1", pinned=True, last_used=1),
            Loaded("u3", last_used=3),
            Loaded("busy", busy=True),
            Loaded("p0", pinned=True, last_used=0),
            Loaded("u1", last_used=1),
        ]
        self.assertEqual([m.name for m in eviction_order(loaded)], ["u1", "u3", "p0", "p1"])

    def test_cpu_evicts_for_ram(self) -> None:
        """
        Without a GPU, idle models are evicted the same way when RAM is
        what is short.
        """
        loaded = [Loaded("r", ram=500 * MiB, last_used=1), Loaded("s", ram=500 * MiB, last_used=2, busy=True)]
        self.assertEqual(summary(place(need(), [], ram_free=1000 * MiB, loaded=loaded)), ((), (), 0, ("r",)))


class NoFitTests(SynchronousTestCase):
    def test_refusals(self) -> None:
        """
        When nothing makes it fit, the refusal says why in figures and
        names the levers: the config keys to change, the models to unload,
        a smaller quantization.
        """
        busy = Loaded("big", {0: 1024 * MiB}, ram=GiB, busy=True)
        cases: list[tuple[str, list[GPUFree], Wishes, list[Loaded], int | None, set[str], list[str]]] = [
            (
                "too little anywhere",
                [gpu(0, 100)],
                Wishes(),
                [],
                100 * MiB,
                {"ctx_size", "parallel", "cache_type_k", "cache_type_v", "quantization"},
                [
                    "m does not fit: it needs 1.2 GiB on one GPU (1.0 GiB of weights, 100 MiB of KV cache for ctx_size "
                    "4096 x parallel 4 at f16/f16, 100 MiB of compute buffer), and the most free is 100 MiB on GPU 0, "
                    "with 100 MiB of RAM free",
                    'lower ctx_size (now 4096) or parallel (now 4) in [models."m"]',
                    'cache_type_k and cache_type_v = "q8_0"',
                    "smaller quantization",
                ],
            ),
            (
                "gpu_layers too many",
                [gpu(0, 800)],
                Wishes(gpu_layers=11),
                [],
                None,
                {"ctx_size", "parallel", "cache_type_k", "cache_type_v", "gpu_layers", "quantization"},
                ["with every layer on the GPU", "set gpu_layers lower"],
            ),
            (
                "gpu_layers too many, busy model",
                [gpu(0, 800)],
                Wishes(gpu_layers=8),
                [busy],
                None,
                {"ctx_size", "parallel", "cache_type_k", "cache_type_v", "gpu_layers", "unload", "quantization"},
                ["with gpu_layers = 8", "unload another model (blazar evict big)"],
            ),
            (
                "RAM short for the CPU part",
                [gpu(0, 800)],
                Wishes(),
                [busy],
                100 * MiB,
                {"ctx_size", "parallel", "cache_type_k", "cache_type_v", "unload", "quantization"},
                ["the rest needs 670 MiB of RAM and 100 MiB is free", "blazar evict big"],
            ),
            (
                "no GPU, RAM short",
                [],
                Wishes(),
                [],
                GiB,
                {"ctx_size", "parallel", "cache_type_k", "cache_type_v", "quantization"},
                ["on the CPU it needs 1.2 GiB of RAM"],
            ),
            (
                "main_gpu not there",
                [gpu(0, 2048)],
                Wishes(main_gpu=3),
                [],
                None,
                {"main_gpu"},
                ["main_gpu = 3 names no GPU it may use (this machine has GPUs 0)", "set main_gpu in"],
            ),
            (
                "devices not there",
                [gpu(0, 2048)],
                Wishes(devices=(2, 3)),
                [],
                None,
                {"devices"},
                ["the GPUs it may use (2, 3) are not on this machine (it has GPUs 0)"],
            ),
        ]
        for label, gpus, wishes, loaded, ram, levers, phrases in cases:
            no = refused(self, place(need(), gpus, wishes=wishes, loaded=loaded, ram_free=ram))
            self.assertEqual(set(no.levers), levers, label)
            for phrase in phrases:
                self.assertIn(phrase, no.message, label)
            self.assertEqual(no.unload, tuple(m.name for m in loaded), label)

    def test_cache_types_already_small(self) -> None:
        no = refused(self, place(need(cache_type_k="q8_0", cache_type_v="q8_0"), [], ram_free=0))
        self.assertIn('to a smaller type ("q4_0")', no.message)
        self.assertNotIn('"q8_0" (about half', no.message)


def meta(**kw: Any) -> GGUFMetadata:
    values: dict[str, Any] = dict(
        architecture="llama",
        context_length=4096,
        block_count=2,
        embedding_length=256,
        head_count=8,
        head_count_kv=2,
        file_type=1,
        has_chat_template=True,
        pooling_type=None,
        size=3000,
        layer_bytes=(1000, 1000),
        other_bytes=1000,
        output_bytes=600,
        input_bytes=400,
        head_count_max=8,
        head_counts_kv=(2, 2),
        key_length=32,
        value_length=32,
        feed_forward_length=1024,
        vocab_size=1000,
    )
    values.update(kw)
    return GGUFMetadata(**values)


class EstimateTests(SynchronousTestCase):
    def test_kv_cache_types(self) -> None:
        """
        KV bytes per layer: cells x heads x (K and V head sizes at ggml's
        bytes per element: f16 2, q8_0 34/32, q4_0 18/32).
        """
        cells = 1024 * 2
        cases = [
            ("f16", "f16", cells * 2 * (64 + 64)),
            ("q8_0", "q8_0", cells * 2 * (34 + 34)),
            ("q4_0", "q4_0", cells * 2 * (18 + 18)),
            ("q8_0", "f16", cells * 2 * (34 + 64)),
            ("f32", "q4_1", cells * 2 * (128 + 20)),
        ]
        for k, v, per_layer in cases:
            estimate = estimate_need("m", meta(), 1024, 2, cache_type_k=k, cache_type_v=v)
            self.assertEqual(estimate.layer_kv, (per_layer,) * 2, (k, v))
            self.assertEqual((estimate.cache_type_k, estimate.cache_type_v), (k, v))
        smaller = [
            estimate_need("m", meta(), 1024, 2, cache_type_k=t, cache_type_v=t).total for t in ("f16", "q8_0", "q4_0")
        ]
        self.assertEqual(smaller, sorted(smaller, reverse=True))
        self.assertRaises(ValueError, estimate_need, "m", meta(), 1024, 2, cache_type_k="q2_k")

    def test_kv_shapes(self) -> None:
        """
        Per-layer KV heads, separate K and V head sizes, llama.cpp's
        padding to 256 cells per stream, and sliding-window layers sized to
        the window plus a micro-batch.
        """
        cases: list[tuple[dict[str, Any], int, int, tuple[int, ...]]] = [
            ({"head_counts_kv": (2, 4)}, 1024, 2, (2048 * 2 * 128, 2048 * 4 * 128)),
            ({"key_length": 64, "value_length": 16}, 1024, 1, (1024 * 2 * 160,) * 2),
            # 1000 x 3 -> n_ctx 3072, 1024 per stream
            ({}, 1000, 3, (3072 * 2 * 128,) * 2),
            ({}, 100, 1, (256 * 2 * 128,) * 2),
            # the window: pad256(min(1024, 128 + 512)) = 768 cells per stream
            ({"swa_layers": (True, False), "sliding_window": 128}, 1024, 2, (1536 * 2 * 128, 2048 * 2 * 128)),
            # no figures at all: n_head_kv falls back to the scalar, head dim to n_embd / n_head
            ({"head_counts_kv": (), "key_length": None, "value_length": None}, 1024, 1, (1024 * 2 * 128,) * 2),
        ]
        for overrides, ctx, parallel, kv in cases:
            self.assertEqual(estimate_need("m", meta(**overrides), ctx, parallel).layer_kv, kv, overrides)

    def test_weights(self) -> None:
        """
        The blocks, output layer and input layer come from the GGUF's
        tensor sizes; a hand-made metadata without them spreads its size.
        """
        estimate = estimate_need("m", meta(), 1024, 1)
        self.assertEqual((estimate.layer_weights, estimate.output, estimate.input), ((1000, 1000), 600, 400))
        self.assertEqual(estimate.n_units, 3)
        bare = estimate_need("m", meta(layer_bytes=(), output_bytes=0, input_bytes=0, size=3001), 1024, 1)
        self.assertEqual((bare.layer_weights, bare.output, bare.input), ((1000, 1000), 1001, 0))
        self.assertEqual(estimate.logits, 4 * 1 * 1000)
        self.assertEqual(estimate.overhead, DEVICE_OVERHEAD)

    def test_compute_buffer(self) -> None:
        """
        The compute buffer against what the pinned llama-server reported
        for SmolLM2-135M (n_embd 576, n_ff 1536, 9 heads), 4096 and 16384
        tokens per slot: with flash attention 18.64 and 30.64 MiB, without
        87.51 and 327.51 MiB. The estimate is within 1 % of the first and
        at most 10 % above the second.
        """
        smol = meta(embedding_length=576, feed_forward_length=1536, head_count=9, head_count_max=9)
        for ctx, flash, reported in [
            (4096, True, 18.64),
            (16384, True, 30.64),
            (4096, False, 87.51),
            (16384, False, 327.51),
        ]:
            estimate = compute_bytes(smol, ctx, flash) / MiB
            self.assertGreaterEqual(estimate, reported * 0.99, (ctx, flash))
            self.assertLessEqual(estimate, reported * 1.1, (ctx, flash))
        # a micro-batch never exceeds the context; embedding children pass their own
        self.assertEqual(
            compute_bytes(smol, 256, True, n_ubatch=DEFAULT_UBATCH), compute_bytes(smol, 256, True, n_ubatch=256)
        )
        self.assertLess(compute_bytes(smol, 4096, True, n_ubatch=128), compute_bytes(smol, 4096, True))

    def test_generated_model(self) -> None:
        """
        From a real GGUF: the tiny generated model's estimate adds up to
        its tensors, its KV cache and the compute buffer, and one GPU
        holds it.
        """
        path = make_test_model(Path(self.mktemp()), n_layer=2, n_embd=64, n_head=4, n_ff=128).path
        facts = thd_read_metadata(path)
        estimate = estimate_need("tiny", facts, 512, 2, overhead=0)
        self.assertEqual(estimate.weights, sum(facts.layer_bytes) + facts.other_bytes)
        self.assertEqual(estimate.kv, 2 * 1024 * 4 * 16 * 2 * 2)  # layers x cells x heads x dim x K,V x f16
        self.assertEqual(estimate.total, sum(estimate.units()) + estimate.compute + estimate.logits)
        plan = place(estimate, [gpu(0, 64)])
        assert isinstance(plan, Plan)
        self.assertEqual((plan.devices, plan.gpu_layers, plan.full), ((0,), 3, True))
        self.assertEqual(plan.gpu_bytes, {0: estimate.total})
        self.assertEqual(plan.ram_bytes, facts.input_bytes)
