"""
A generator of tiny vision projectors (C{mmproj} GGUFs) for the tiny test
model (L{blazar.models.testmodel}): with one beside a model, llama-server
(C{--mmproj}) takes images for it, so the vision path is tested end to end
on the real engine in well under a second.

The projector is a LLaVA-style CLIP (C{clip.projector_type = "mlp"}, as
llama.cpp's C{tools/mtmd/clip.cpp} of the pinned engine reads it): a
patch embedding (a C{patch_size} convolution), position embeddings, one
encoder block (loaded; the LLaVA graph stops before the last block, so it
never runs) and the two-layer MLP C{mm.0} / C{mm.2} into the text model's
embedding width. Its weights are random: an image costs
C{(image_size / patch_size) ** 2} prompt tokens (L{image_tokens}) and is
seen as noise, which is what a plumbing test needs.
"""

from __future__ import annotations

import os
from pathlib import Path

from blazar.models.testmodel import write_whole

IMAGE_SIZE = 32  # pixels a side: every image is resized (padded) to this square
PATCH_SIZE = 8  # pixels a side of a patch: one prompt token each


def image_tokens(image_size: int = IMAGE_SIZE, patch_size: int = PATCH_SIZE) -> int:
    """
    The prompt tokens one image costs with a projector made with these
    sizes (the MLP projector makes one token per patch).
    """
    return (image_size // patch_size) ** 2


def png_image(width: int = 4, height: int = 4, rgb: tuple[int, int, int] = (255, 0, 0)) -> bytes:
    """
    A small one-colour PNG (8-bit RGB, no filter): an image any decoder
    reads, for the tests that send one.
    """
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def make_test_projector(
    path: str | os.PathLike[str],
    *,
    text_embd: int = 64,
    seed: int = 0,
    image_size: int = IMAGE_SIZE,
    patch_size: int = PATCH_SIZE,
    n_embd: int = 32,
    n_ff: int = 64,
    n_head: int = 4,
    hidden: int = 64,
) -> Path:
    """
    Write a tiny random-weight CLIP projector GGUF to C{path} (a few tens
    of KB); name it C{*mmproj*.gguf} beside its model for the registry to
    pair them.

    Blocking: writes a file (through a temporary name, so it appears whole).

    @param text_embd: The text model's embedding width (its
        C{llama.embedding_length}: 64 for L{make_test_model}'s default);
        llama.cpp refuses a projector whose output width differs.
    @param seed: Seeds the weights; the same seed gives the same file.
    @param image_size: Pixels a side images are resized to.
    @param patch_size: Pixels a side of a patch (it must divide
        C{image_size}).
    @param n_embd: The vision encoder's width.
    @param hidden: The MLP projector's hidden width.
    @return: The file written.
    """
    import numpy as np
    from gguf import GGUFWriter

    if image_size % patch_size:
        raise ValueError(f"patch_size {patch_size} does not divide image_size {image_size}")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    patches = (image_size // patch_size) ** 2

    def weights(*shape: int) -> "np.ndarray":
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    tmp = out.with_name(out.name + ".tmp")
    writer = GGUFWriter(os.fspath(tmp), "clip")
    writer.add_name("blazar-test-mmproj")
    writer.add_file_type(0)  # ALL_F32
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_uint32("clip.vision.image_size", image_size)
    writer.add_uint32("clip.vision.patch_size", patch_size)
    writer.add_uint32("clip.vision.embedding_length", n_embd)
    writer.add_uint32("clip.vision.feed_forward_length", n_ff)
    writer.add_uint32("clip.vision.projection_dim", text_embd)
    writer.add_uint32("clip.vision.attention.head_count", n_head)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_uint32("clip.vision.block_count", 1)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_bool("clip.use_gelu", True)

    # numpy shapes are GGUF's dimensions reversed: (out, in) for a matrix
    writer.add_tensor("v.patch_embd.weight", weights(n_embd, 3, patch_size, patch_size))
    writer.add_tensor("v.position_embd.weight", weights(patches, n_embd))
    block = "v.blk.0"
    for name, shape in [
        ("attn_q", (n_embd, n_embd)),
        ("attn_k", (n_embd, n_embd)),
        ("attn_v", (n_embd, n_embd)),
        ("attn_out", (n_embd, n_embd)),
        ("ffn_up", (n_ff, n_embd)),
        ("ffn_down", (n_embd, n_ff)),
    ]:
        writer.add_tensor(f"{block}.{name}.weight", weights(*shape))
        writer.add_tensor(f"{block}.{name}.bias", np.zeros(shape[0], dtype=np.float32))
    for norm in ("ln1", "ln2"):
        writer.add_tensor(f"{block}.{norm}.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{block}.{norm}.bias", np.zeros(n_embd, dtype=np.float32))
    writer.add_tensor("mm.0.weight", weights(hidden, n_embd))
    writer.add_tensor("mm.0.bias", np.zeros(hidden, dtype=np.float32))
    writer.add_tensor("mm.2.weight", weights(text_embd, hidden))
    writer.add_tensor("mm.2.bias", np.zeros(text_embd, dtype=np.float32))

    write_whole(writer, tmp, out)
    return out
