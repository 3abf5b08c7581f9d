"""Write a tiny transformers Llama (see ``conftest.tiny_model``) as an F32 GGUF file that
llama.cpp loads, with a byte-level BPE vocabulary of single characters, so the tests that
run on the transformers backend run unchanged on the llama.cpp backend.

Tensor names and the q/k row permutation follow llama.cpp's ``convert_hf_to_gguf.py``
(``LlamaModel``): llama.cpp applies RoPE to interleaved pairs, transformers to halves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from conftest import ALPHABET


def _byte_level(text: str) -> str:
    """GPT-2's byte → unicode map for the characters the tests use (space → Ġ, \\n → Ċ)."""
    return "".join({" ": "\u0120", "\n": "\u010a"}.get(c, c) for c in text)


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_tiny_gguf(model, path: Path, *, eos: int | None = None) -> Path:
    """Write ``model`` (a ``LlamaForCausalLM`` whose vocabulary is ≤ ``len(ALPHABET)``)
    to ``path`` as an F32 GGUF with one token per character; returns ``path``."""
    import gguf

    config = model.config
    vocab = config.vocab_size
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([_byte_level(c) for c in ALPHABET[:vocab]])
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
    writer.add_token_merges(["a b"])  # llama.cpp requires the key; "ab" is not a token
    writer.add_add_bos_token(False)
    if eos is not None:
        writer.add_eos_token_id(eos)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            module = rest.removesuffix(".weight")
            if module == "self_attn.q_proj":
                array = _permute(array, config.num_attention_heads)
            elif module == "self_attn.k_proj":
                array = _permute(array, config.num_key_value_heads)
            gguf_name = f"blk.{index}.{per_layer[module]}.weight"
        else:
            gguf_name = names[name]
        writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
