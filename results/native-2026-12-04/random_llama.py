"""Write a randomly initialised Llama-shaped GGUF file with SmolLM2-1.7B's shape (2048
wide, 24 layers, 32 heads, 8192 feed-forward, 49,152-token vocabulary, tied embeddings:
1.71 B parameters) in Q4_0 blocks, for measuring forward costs where users run speculation.
The metadata (tokenizer, chat template) is the embedded SmolLM2-135M file's, the shape
numbers replaced; the weights are random Q4_0 blocks (uniform nibbles, one small scale per
block), so the text it writes means nothing: only its costs are of use.

    .venv/bin/python results/native-2026-12-04/random_llama.py OUT.gguf
"""

import sys

import gguf
import numpy as np

from exactspec.model_files import resolve_model_path

E, LAYERS, HEADS, KV_HEADS, FF, VOCAB = 2048, 24, 32, 32, 8192, 49152
out = sys.argv[1]
source = gguf.GGUFReader(resolve_model_path("smollm2-135m-instruct"))
shape = {"llama.embedding_length": E, "llama.block_count": LAYERS,
         "llama.feed_forward_length": FF, "llama.attention.head_count": HEADS,
         "llama.attention.head_count_kv": KV_HEADS, "llama.rope.dimension_count": E // HEADS,
         "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q4_0)}
writer = gguf.GGUFWriter(out, "llama")
for field in source.fields.values():
    if field.name == "general.architecture" or field.name.startswith("GGUF."):
        continue
    sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(field.name, shape.get(field.name, field.contents()), field.types[0],
                         sub_type=sub_type)
rng = np.random.default_rng(0)
Q4_0 = gguf.GGMLQuantizationType.Q4_0


def q4_0(rows, cols, std=0.02):
    """Random Q4_0 blocks: nibbles uniform in 0..15 (values -8..7), scale std / 4.6."""
    blocks = rows * cols // 32
    raw = np.empty((blocks, 18), np.uint8)
    raw[:, :2] = np.frombuffer(np.float16(std / 4.6).tobytes(), np.uint8)
    raw[:, 2:] = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
    return raw.reshape(rows, cols // 32 * 18)


ones = np.ones(E, np.float32)
writer.add_tensor("token_embd.weight", q4_0(VOCAB, E), raw_dtype=Q4_0)
writer.add_tensor("output_norm.weight", ones)
for layer in range(LAYERS):
    p = f"blk.{layer}."
    writer.add_tensor(p + "attn_norm.weight", ones)
    writer.add_tensor(p + "ffn_norm.weight", ones)
    for name, rows, cols in (("attn_q", E, E), ("attn_k", E // HEADS * KV_HEADS, E),
                             ("attn_v", E // HEADS * KV_HEADS, E), ("attn_output", E, E),
                             ("ffn_gate", FF, E), ("ffn_up", FF, E), ("ffn_down", E, FF)):
        writer.add_tensor(p + name + ".weight", q4_0(rows, cols), raw_dtype=Q4_0)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
