"""
A generator of tiny GGUF models that a real llama-server loads in well
under a second (C{blazar models make-test}; the test suites use it too).

The model is llama-architecture with random weights (its output is noise:
it checks plumbing, not prose), a SentencePiece-style ("llama")
vocabulary of byte tokens, a few words and the chat template's special
tokens, and a Qwen2.5-style ChatML template that can render tools, so
llama.cpp's Hermes-style tool-call parser is used for it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

# Qwen2.5's chat template (tool-capable ChatML), trimmed of its long default
# system prompt. llama.cpp recognises the <tool_call> format from it.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a test model.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

_CONTROL = ["<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
_USER_DEFINED = ["<tool_call>", "</tool_call>"]
_WORDS = [
    "\n",
    "hello",
    "▁hello",
    "▁world",
    "▁the",
    "▁a",
    "▁is",
    "▁test",
    "▁model",
    "{",
    "}",
    '"',
    ":",
    ",",
    "▁",
    "name",
    "arguments",
    "true",
    "false",
    "null",
    "▁yes",
    "▁no",
    "ok",
    ".",
    "!",
    "?",
]

# A template that, like Mistral's and Gemma's, takes a system message only
# first and raises on a later one (for the placement tests).
STRICT_CHAT_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == 'system' and not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{%- endif %}
{%- if message.role == 'system' or message.role == 'user' %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- if message.tool_calls %}{%- for call in message.tool_calls %}{{- '<tool_call>\\n' + call.function.name + '\\n</tool_call>' }}{%- endfor %}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# A thinking template like Qwen3's: the generation prompt opens <think>
# (closed at once when enable_thinking is false), and an assistant turn's
# reasoning_content renders inside <think></think>, so llama.cpp extracts
# the model's output up to </think> as reasoning_content.
_PLAIN_TURN = "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}",
).replace(
    _PLAIN_TURN,
    "{%- if message.role == 'assistant' and message.reasoning_content is defined and message.reasoning_content %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' + message.content"
    " + '<|im_end|>\\n' }}{%- else %}" + _PLAIN_TURN + "{%- endif %}",
)
assert THINKING_CHAT_TEMPLATE.count("<think>") == 3

# gguf.TokenType values
_NORMAL, _UNKNOWN, _CONTROL_T, _USER, _BYTE = 1, 2, 3, 4, 6


@attrs.frozen
class GeneratedModel:
    """
    What L{make_test_model} wrote.

    @ivar path: The GGUF file.
    @ivar token_ids: Token text to id, for C{logit_bias} in tests
        (e.g. C{token_ids["<tool_call>"]}, C{token_ids["\\n"]}).
    """

    path: Path
    token_ids: dict[str, int]


def write_whole(writer: Any, tmp: Path, out: Path) -> None:
    """
    Write what the L{gguf.GGUFWriter} C{writer} holds (header, metadata,
    tensors) to its file C{tmp}, close it, then rename it C{out}, so the
    model appears whole or not at all.
    """
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)


def vocabulary() -> tuple[list[str], list[int]]:
    """
    The test model's tokens and their GGUF token types, in id order.
    """
    tokens = ["<unk>", "<s>", "</s>"]
    types = [_UNKNOWN, _CONTROL_T, _CONTROL_T]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [_BYTE] * 256
    tokens += _CONTROL
    types += [_CONTROL_T] * len(_CONTROL)
    tokens += _USER_DEFINED
    types += [_USER] * len(_USER_DEFINED)
    tokens += _WORDS
    types += [_NORMAL] * len(_WORDS)
    return tokens, types


def make_test_model(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    embedding: bool = False,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_ff: int = 128,
    context_length: int = 2048,
    chat_template: str = CHAT_TEMPLATE,
    architecture: str = "llama",
    rerank: bool = False,
    extra_words: tuple[str, ...] = (),
) -> GeneratedModel:
    """
    Write a tiny random-weight llama GGUF to C{path} (about 0.5 MB).

    Blocking: writes a file. C{tokenizer.ggml.add_space_prefix} is false:
    with it true, llama.cpp's grammar sampler fails to initialise on this
    vocabulary ("Failed to initialize samplers").

    @param seed: Seeds the weights; the same seed gives the same file.
    @param embedding: Mark the model for mean-pooled embeddings.
    @param chat_template: Its Jinja chat template (L{STRICT_CHAT_TEMPLATE}:
        one that takes a system message only first; L{THINKING_CHAT_TEMPLATE}:
        one that thinks first).
    @param rerank: A reranker: rank pooling (llama-server C{--rerank} scores
        a query and a document by the pooled state's first value).
    @param architecture: C{general.architecture}: another name makes a file
        llama.cpp refuses to load ("unknown model architecture").
    @param extra_words: Normal tokens added after the usual vocabulary: a
        model whose vocabulary differs (a draft model that does not fit,
        L{blazar.models.speculative}).
    """
    import numpy as np
    from gguf import GGUFWriter

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tokens, types = vocabulary()
    tokens, types = tokens + list(extra_words), types + [_NORMAL] * len(extra_words)
    n_vocab = len(tokens)
    head_dim = n_embd // n_head

    def weights(*shape: int) -> "np.ndarray":
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    tmp = out.with_name(out.name + ".tmp")
    writer = GGUFWriter(os.fspath(tmp), architecture)
    writer.add_name("blazar-test-rerank" if rerank else "blazar-test-embed" if embedding else "blazar-test")
    writer.add_file_type(0)  # ALL_F32
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    if embedding or rerank:
        from gguf import PoolingType

        writer.add_pooling_type(PoolingType.RANK if rerank else PoolingType.MEAN)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0 if t != _NORMAL else -float(len(tok)) for tok, t in zip(tokens, types)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    # fill-in-the-middle tokens, so llama-server's /infill works
    writer.add_uint32("tokenizer.ggml.fim_pre_token_id", tokens.index("<|fim_prefix|>"))
    writer.add_uint32("tokenizer.ggml.fim_suf_token_id", tokens.index("<|fim_suffix|>"))
    writer.add_uint32("tokenizer.ggml.fim_mid_token_id", tokens.index("<|fim_middle|>"))
    writer.add_chat_template(chat_template)

    writer.add_tensor("token_embd.weight", weights(n_vocab, n_embd))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weights(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", weights(n_vocab, n_embd))

    write_whole(writer, tmp, out)
    return GeneratedModel(out, {tok: i for i, tok in enumerate(tokens)})


# the model's matrices a test adapter adapts, and each one's (rows, columns) as numpy shapes them
_LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def make_test_lora(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_embd: int = 64,
    n_layer: int = 2,
    n_ff: int = 128,
    rank: int = 4,
    alpha: float = 8.0,
    architecture: str = "llama",
    targets: tuple[str, ...] = _LORA_TARGETS,
) -> Path:
    """
    Write a tiny random-weight LoRA adapter GGUF for the model
    L{make_test_model} makes with the same C{n_embd}, C{n_layer} and
    C{n_ff}, as llama.cpp's C{src/llama-adapter.cpp} loads it: C{general.type
    = "adapter"}, C{adapter.type = "lora"}, C{adapter.lora.alpha}, the
    model's C{general.architecture}, and for each adapted matrix
    C{blk.N.<name>.weight.lora_a} (C{rank} x the matrix's input width) and
    C{.lora_b} (its output width x C{rank}), f32. Blocking: writes a file.

    @param targets: The matrices adapted in every block (C{attn_q},
        C{ffn_down}, ...).
    @return: The file.
    """
    import numpy as np
    from gguf import GGUFWriter

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    # (output width, input width) of each matrix: numpy's order, the reverse of ggml's ne
    shapes = {
        "attn_q": (n_embd, n_embd),
        "attn_k": (n_embd, n_embd),
        "attn_v": (n_embd, n_embd),
        "attn_output": (n_embd, n_embd),
        "ffn_gate": (n_ff, n_embd),
        "ffn_up": (n_ff, n_embd),
        "ffn_down": (n_embd, n_ff),
    }
    tmp = out.with_name(out.name + ".tmp")
    writer = GGUFWriter(os.fspath(tmp), architecture)
    writer.add_type("adapter")
    writer.add_name("blazar-test-lora")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for i in range(n_layer):
        for target in targets:
            rows, columns = shapes[target]
            writer.add_tensor(
                f"blk.{i}.{target}.weight.lora_a", (rng.standard_normal((rank, columns)) * 0.1).astype(np.float32)
            )
            writer.add_tensor(
                f"blk.{i}.{target}.weight.lora_b", (rng.standard_normal((rows, rank)) * 0.1).astype(np.float32)
            )
    write_whole(writer, tmp, out)
    return out
