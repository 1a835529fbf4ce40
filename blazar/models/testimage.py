"""
A generator of tiny random-weight text-to-image models that
stable-diffusion.cpp's C{sd-server} (as vendored in
stable-diffusion-cpp-python 0.4.7) loads as "Flux.2 klein" and samples
from (C{blazar models make-test --image}; the test suites use it too).

Why Flux.2 klein: the UNet families (SD1.x, SD2, SDXL, SD-Turbo, SDXS)
have hard-coded channel counts (320/640/1280) and a hard-coded CLIP, but
for Flux.2 klein stable-diffusion.cpp infers what it needs from the
tensors' names and shapes:
  - the DiT (flux.hpp): depth from the block indices, hidden and context
    sizes from C{txt_in.weight}, head_dim from C{key_norm.scale}; RoPE
    axes are fixed at {32,32,32,32}, so head_dim is 128 (hidden 128: one
    head); in/out channels are 128 (a 32-channel latent, 2x2 patches);
  - the text encoder (llm.hpp, Qwen3): layers, hidden size, vocabulary
    and MLP width from the tensors; Flux.2 klein reads hidden layers
    {9, 18, 27}, so 28 layers; the vocabulary covers Qwen2's token ids
    (151936 rows);
  - the VAE: a tiny TAEF2-style autoencoder in a second file, passed with
    C{--taesd} (the full VAE's encoder has a fixed size, ~34M parameters).
Version detection (model.cpp C{get_sd_version}): C{double_blocks.} is
Flux, C{double_stream_modulation_img.lin.weight} Flux.2, no
C{single_blocks.47} klein.

About 12.5 MB plus a 5.4 MB autoencoder, written in half a second; a 64x64
image in one step takes 3-4 s on 2 cores (most of it the 28-layer text
encoder over 512 padded tokens). Its images are noise: it checks plumbing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from blazar.models.testmodel import write_whole

VOCAB = 151936
HEAD_DIM = 128


def _build(
    llm_hidden: int = 16,
    llm_inter: int = 16,
    llm_layers: int = 28,
    dit_hidden: int = 128,
    dit_double: int = 1,
    dit_single: int = 1,
    vae_ch: int = 32,
    encoder: bool = True,
) -> list[tuple[str, list[int]]]:
    """Return list of (name, ne) with ne in ggml order (ne[0] = fastest dim)."""
    t: list[tuple[str, list[int]]] = []
    H = dit_hidden
    ctx_in = 3 * llm_hidden  # concat of 3 LLM hidden layers
    mlp = 3 * H  # mlp_ratio 3
    p = "model.diffusion_model."
    t += [
        (p + "img_in.weight", [128, H]),
        (p + "txt_in.weight", [ctx_in, H]),
        (p + "time_in.in_layer.weight", [256, H]),
        (p + "time_in.out_layer.weight", [H, H]),
        (p + "double_stream_modulation_img.lin.weight", [H, 6 * H]),
        (p + "double_stream_modulation_txt.lin.weight", [H, 6 * H]),
        (p + "single_stream_modulation.lin.weight", [H, 3 * H]),
        (p + "final_layer.adaLN_modulation.1.weight", [H, 2 * H]),
        (p + "final_layer.linear.weight", [H, 128]),
    ]
    for i in range(dit_double):
        b = f"{p}double_blocks.{i}."
        for s in ("img", "txt"):
            t += [
                (b + f"{s}_attn.norm.key_norm.scale", [HEAD_DIM]),
                (b + f"{s}_attn.norm.query_norm.scale", [HEAD_DIM]),
                (b + f"{s}_attn.proj.weight", [H, H]),
                (b + f"{s}_attn.qkv.weight", [H, 3 * H]),
                (b + f"{s}_mlp.0.weight", [H, 2 * mlp]),  # SiLU-gated: x2
                (b + f"{s}_mlp.2.weight", [mlp, H]),
            ]
    for i in range(dit_single):
        b = f"{p}single_blocks.{i}."
        t += [
            (b + "linear1.weight", [H, 3 * H + 2 * mlp]),
            (b + "linear2.weight", [H + mlp, H]),
            (b + "norm.key_norm.scale", [HEAD_DIM]),
            (b + "norm.query_norm.scale", [HEAD_DIM]),
        ]

    # Qwen3-style text encoder
    q_heads = 16 if llm_layers == 28 else 32
    p = "text_encoders.llm.model."
    t += [(p + "embed_tokens.weight", [llm_hidden, VOCAB]), (p + "norm.weight", [llm_hidden])]
    for i in range(llm_layers):
        b = f"{p}layers.{i}."
        t += [
            (b + "input_layernorm.weight", [llm_hidden]),
            (b + "post_attention_layernorm.weight", [llm_hidden]),
            (b + "mlp.gate_proj.weight", [llm_hidden, llm_inter]),
            (b + "mlp.up_proj.weight", [llm_hidden, llm_inter]),
            (b + "mlp.down_proj.weight", [llm_inter, llm_hidden]),
            (b + "self_attn.q_proj.weight", [llm_hidden, q_heads * HEAD_DIM]),
            (b + "self_attn.k_proj.weight", [llm_hidden, 8 * HEAD_DIM]),
            (b + "self_attn.v_proj.weight", [llm_hidden, 8 * HEAD_DIM]),
            (b + "self_attn.o_proj.weight", [q_heads * HEAD_DIM, llm_hidden]),
            (b + "self_attn.q_norm.weight", [HEAD_DIM]),
            (b + "self_attn.k_norm.weight", [HEAD_DIM]),
        ]

    # VAE decoder (flux2 VAE layout, ch_mult 1,2,4,4, num_res_blocks 2 -> 3 per level)
    p = "first_stage_model."
    z = 32
    mult = [1, 2, 4, 4]
    top = vae_ch * mult[-1]

    def conv(name: str, cin: int, cout: int, k: int) -> list[tuple[str, list[int]]]:
        return [(name + ".weight", [k, k, cin, cout]), (name + ".bias", [cout])]

    def norm(name: str, c: int) -> list[tuple[str, list[int]]]:
        return [(name + ".weight", [c]), (name + ".bias", [c])]

    def resblock(name: str, cin: int, cout: int) -> list[tuple[str, list[int]]]:
        r = norm(name + ".norm1", cin) + conv(name + ".conv1", cin, cout, 3)
        r += norm(name + ".norm2", cout) + conv(name + ".conv2", cout, cout, 3)
        if cin != cout:
            r += conv(name + ".nin_shortcut", cin, cout, 1)
        return r

    def mid(coder: str, ch: int) -> list[tuple[str, list[int]]]:
        # the decoder's and the encoder's middle: two resblocks around a 1x1-conv attention
        r = resblock(coder + "mid.block_1", ch, ch) + resblock(coder + "mid.block_2", ch, ch)
        r += norm(coder + "mid.attn_1.norm", ch)
        for n in ("q", "k", "v", "proj_out"):
            r += conv(coder + "mid.attn_1." + n, ch, ch, 1)
        return r

    def levels(way: str, ch: int, base: int, order: list[int], blocks: int) -> tuple[list[tuple[str, list[int]]], int]:
        # the resolution levels, in C{order}: C{blocks} resblocks each (to C{base} x its multiplier
        # channels), then an up- or downsampling conv but after the last; the tensors and the
        # channels they end with
        r: list[tuple[str, list[int]]] = []
        for lvl in order:
            cout = base * mult[lvl]
            for j in range(blocks):
                r += resblock(f"{way}.{lvl}.block.{j}", ch, cout)
                ch = cout
            if lvl != order[-1]:
                r += conv(f"{way}.{lvl}.{way.rsplit('.', 1)[-1]}sample.conv", ch, ch, 3)
        return r, ch

    t += conv(p + "post_quant_conv", z, z, 1)
    d = p + "decoder."
    t += conv(d + "conv_in", z, top, 3)
    t += mid(d, top)
    r, ch = levels(d + "up", top, vae_ch, [3, 2, 1, 0], 3)
    t += r
    t += norm(d + "norm_out", ch) + conv(d + "conv_out", ch, 3, 3)

    # VAE encoder: sd-server always builds the context with vae_decode_only=false, so the
    # encoder + quant_conv must be present. Its base ch is NOT inferred (fixed 128), so this
    # part is full-size (~34M params) and dominates the file.
    if encoder:
        e = p + "encoder."
        ech = 128
        t += conv(p + "quant_conv", 2 * z, 2 * z, 1)
        t += conv(e + "conv_in", 3, ech, 3)
        r, ch = levels(e + "down", ech, ech, [0, 1, 2, 3], 2)
        t += r
        t += mid(e, ch)
        t += norm(e + "norm_out", ch) + conv(e + "conv_out", ch, 2 * z, 3)
    return t


def _build_tae(z: int = 32, c: int = 64, n_gn: int = 256) -> list[tuple[str, list[int]]]:
    """TAEF2-style tiny autoencoder (tae.hpp TAESD with taef2=true), names as stored in the
    --taesd file (sd.cpp adds the "tae." prefix). Channels are fixed at 64."""
    t: list[tuple[str, list[int]]] = []

    def conv(name: str, cin: int, cout: int, k: int = 3, bias: bool = True) -> list[tuple[str, list[int]]]:
        r = [(name + ".weight", [k, k, cin, cout])]
        return r + [(name + ".bias", [cout])] if bias else r

    def block(name: str, gn: bool = False) -> list[tuple[str, list[int]]]:
        r: list[tuple[str, list[int]]] = []
        for i in (0, 2, 4):
            r += conv(f"{name}.conv.{i}", c, c)
        if gn:
            r += conv(name + ".pool.0", c, n_gn, 1, False)
            r += [(name + ".pool.1.weight", [n_gn]), (name + ".pool.1.bias", [n_gn])]
            r += conv(name + ".pool.3", n_gn, c, 1, False)
        return r

    d = "decoder.layers."
    t += conv(d + "0", z, c)
    for i in (2, 3, 4):
        t += block(d + str(i), gn=True)
    for up, blocks in ((6, (7, 8, 9)), (11, (12, 13, 14)), (16, (17,))):
        t += conv(d + str(up), c, c, 3, False)
        for i in blocks:
            t += block(d + str(i))
    t += conv(d + "18", c, 3)
    e = "encoder.layers."
    t += conv(e + "0", 3, c) + block(e + "1")
    for down, blocks, gn in ((2, (3, 4, 5), False), (6, (7, 8, 9), False), (10, (11, 12, 13), True)):
        t += conv(e + str(down), c, c, 3, False)
        for i in blocks:
            t += block(e + str(i), gn=gn)
    t += conv(e + "14", c, z)
    return t


def _write_gguf(path: Path, tensors: list[tuple[str, list[int]]], rng: Any, std: float) -> None:
    import gguf
    import numpy as np

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(tmp, arch="flux")  # sd.cpp ignores it; Blazar routes flux GGUFs to the sdcpp lane
    n_params = 0
    for name, ne in tensors:
        shape = tuple(reversed(ne))  # numpy order is the reverse of ggml ne
        if len(ne) == 1:
            if name.endswith(
                (
                    "norm.weight",
                    "layernorm.weight",
                    "_norm.weight",
                    ".scale",
                    "norm1.weight",
                    "norm2.weight",
                    "norm_out.weight",
                    "pool.1.weight",
                )
            ):
                arr = np.ones(shape, dtype=np.float32)
            else:
                arr = np.zeros(shape, dtype=np.float32)
        else:
            arr = (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float16)
        n_params += arr.size
        w.add_tensor(name, arr)
    write_whole(w, tmp, path)


def make_test_image_model(path: Path, tae: Path, *, seed: int = 0, std: float = 0.02) -> tuple[Path, Path]:
    """
    Write the model to C{path} and its tiny autoencoder to C{tae}
    (start C{sd-server} with C{--taesd TAE}), atomically.

    @return: C{(path, tae)}.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    path, tae = Path(path), Path(tae)
    tensors = [t for t in _build() if not t[0].startswith("first_stage_model.")]
    _write_gguf(tae, _build_tae(), rng, std)
    _write_gguf(path, tensors, rng, std)
    return path, tae
