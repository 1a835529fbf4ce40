"""
A generator of tiny random-weight whisper models in the ggml layout
whisper.cpp's C{whisper_model_load} reads (C{blazar models make-test
--whisper}; the test suites use it too): the C{ggml} magic, eleven int32
hyperparameters, the mel filterbank, the vocabulary, then each tensor
(n_dims, name length, type, the dimensions fastest first, the name, the
data) under the names of whisper.cpp's C{ASR_TENSOR_NAMES}.

Its transcripts are noise: it checks plumbing (upload, conversion, the
child, every response format), not recognition. About 8 MB (the
multilingual vocabulary's token embedding is most of it), written in
well under a second; whisper-server loads it in a fraction of one.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

GGML_MAGIC = 0x67676D6C  # "ggml", as whisper.cpp's GGML_FILE_MAGIC
N_VOCAB = 51865  # multilingual: language tokens, translate and transcribe exist
N_AUDIO_CTX = 1500  # 30 s windows, as every whisper model has
N_TEXT_CTX = 448
N_MELS = 80
N_FFT_BINS = 201  # 1 + WHISPER_N_FFT / 2


def _tensors(state: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """
    Names and numpy shapes (slowest dimension first) of every tensor.
    """
    out: list[tuple[str, tuple[int, ...]]] = [
        ("encoder.positional_embedding", (N_AUDIO_CTX, state)),
        ("encoder.conv1.weight", (state, N_MELS, 3)),
        ("encoder.conv1.bias", (state, 1)),
        ("encoder.conv2.weight", (state, state, 3)),
        ("encoder.conv2.bias", (state, 1)),
        ("encoder.ln_post.weight", (state,)),
        ("encoder.ln_post.bias", (state,)),
        ("decoder.positional_embedding", (N_TEXT_CTX, state)),
        ("decoder.token_embedding.weight", (N_VOCAB, state)),
        ("decoder.ln.weight", (state,)),
        ("decoder.ln.bias", (state,)),
    ]

    def block(prefix: str, cross: bool) -> list[tuple[str, tuple[int, ...]]]:
        parts = [
            (f"{prefix}.mlp_ln.weight", (state,)),
            (f"{prefix}.mlp_ln.bias", (state,)),
            (f"{prefix}.mlp.0.weight", (4 * state, state)),
            (f"{prefix}.mlp.0.bias", (4 * state,)),
            (f"{prefix}.mlp.2.weight", (state, 4 * state)),
            (f"{prefix}.mlp.2.bias", (state,)),
        ]
        for attn in ("attn", "cross_attn") if cross else ("attn",):
            parts += [
                (f"{prefix}.{attn}_ln.weight", (state,)),
                (f"{prefix}.{attn}_ln.bias", (state,)),
                (f"{prefix}.{attn}.query.weight", (state, state)),
                (f"{prefix}.{attn}.query.bias", (state,)),
                (f"{prefix}.{attn}.key.weight", (state, state)),
                (f"{prefix}.{attn}.value.weight", (state, state)),
                (f"{prefix}.{attn}.value.bias", (state,)),
                (f"{prefix}.{attn}.out.weight", (state, state)),
                (f"{prefix}.{attn}.out.bias", (state,)),
            ]
        return parts

    for i in range(layers):
        out += block(f"encoder.blocks.{i}", cross=False)
    for i in range(layers):
        out += block(f"decoder.blocks.{i}", cross=True)
    return out


def make_test_whisper_model(path: Path, *, state: int = 64, heads: int = 2, layers: int = 1, seed: int = 0) -> Path:
    """
    Write a random-weight whisper model to C{path}, atomically: ftype 1
    (the matrices and the convolutions in f16, as whisper.cpp's convolution
    needs them; embeddings, norms and biases in f32).

    @return: C{path}.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(struct.pack("<I", GGML_MAGIC))
        f.write(
            struct.pack("<11i", N_VOCAB, N_AUDIO_CTX, state, heads, layers, N_TEXT_CTX, state, heads, layers, N_MELS, 1)
        )
        f.write(struct.pack("<2i", N_MELS, N_FFT_BINS))
        f.write(rng.uniform(0.0, 0.02, N_MELS * N_FFT_BINS).astype("<f4").tobytes())
        # the text tokens: printable ASCII, the ones whisper.cpp's decoder looks
        # up by text (" ", " -", " '"), then words, so a transcript is printable noise
        words = [chr(c) for c in range(33, 127)] + [" ", " -", " '"]
        words += [f" w{i}" for i in range(len(words), 50257)]
        f.write(struct.pack("<i", len(words)))
        for word in words:
            spelled = word.encode("utf-8")
            f.write(struct.pack("<I", len(spelled)) + spelled)
        for name, shape in _tensors(state, layers):
            encoded = name.encode("ascii")
            half = name.endswith(".weight") and len(shape) > 1 and "positional" not in name
            f.write(struct.pack("<3i", len(shape), len(encoded), 1 if half else 0))  # ggml type: f16 or f32
            f.write(struct.pack(f"<{len(shape)}i", *reversed(shape)))
            f.write(encoded)
            if name.endswith("ln.weight") or name.endswith("ln_post.weight"):
                data = np.ones(shape, "<f4")
            elif name.endswith(".bias"):
                data = np.zeros(shape, "<f4")
            else:
                data = rng.normal(0.0, 0.02, shape).astype("<f2" if half else "<f4")
            f.write(data.tobytes())
    os.replace(tmp, path)
    return path
