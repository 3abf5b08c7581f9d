"""The backends (transformers and llama.cpp, through ``make_backend``): cache bookkeeping,
exact rollback, logits for exactly the positions asked for, refusals."""

import pytest
import torch

from exactspec.backends import TransformersBackend, UnsupportedModelError

from conftest import CharTokenizer, one


def test_forward_after_rollback_equals_a_fresh_forward(make_backend):
    backend = make_backend(0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    one(backend).prefill(prompt)
    assert one(backend).num_cached_tokens == 8
    one(backend).forward([7, 7, 7, 7])  # a rejected draft block
    one(backend).rollback(4)
    assert one(backend).num_cached_tokens == 8
    after_rollback = one(backend).forward([5, 3])
    one(backend).prefill(prompt)
    fresh = one(backend).forward([5, 3])
    assert torch.equal(after_rollback, fresh)
    assert after_rollback.shape == (2, backend.vocab_size)


@pytest.mark.parametrize("num_tokens", [2, 3, 8, 9, 17])
def test_block_forward_is_bit_identical_to_one_token_forwards(num_tokens, make_backend):
    backend = make_backend(1)
    assert backend.batch_invariant
    tokens = [(5 * i + 4) % backend.vocab_size for i in range(num_tokens)]
    one(backend).prefill([1, 2, 3])
    block = one(backend).forward(tokens)
    one(backend).prefill([1, 2, 3])
    singles = torch.stack([one(backend).forward([t])[0] for t in tokens])
    assert torch.equal(block, singles)
    one(backend).prefill([1, 2, 3])
    last = one(backend).forward(tokens, num_logits=1)
    assert last.shape == (1, backend.vocab_size)
    assert torch.equal(last[0], block[-1])
    assert one(backend).num_cached_tokens == 3 + num_tokens


def test_prefill_resets_and_bad_calls_raise(make_backend):
    backend = make_backend(0)
    one(backend).prefill([1, 2, 3])
    one(backend).prefill([])
    assert one(backend).num_cached_tokens == 0
    with pytest.raises(ValueError, match=r"rollback\(\d+, 1\) is invalid: the sequence holds 0 tokens"):
        one(backend).rollback(1)
    with pytest.raises(ValueError, match="rollback"):
        one(backend).rollback(-1)
    with pytest.raises(ValueError, match="at least one token"):
        one(backend).forward([])


def test_sliding_window_model_is_refused():
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM

    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=16, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(UnsupportedModelError, match="cannot be rolled back"):
        TransformersBackend(Gemma3ForCausalLM(config), CharTokenizer())


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TransformersBackend.load(tmp_path / "missing")
    with pytest.raises(ValueError, match="dtype 'float8' is invalid"):
        TransformersBackend.load(tmp_path, dtype="float8")
    with pytest.raises(ValueError, match="device 'gpu7' is invalid"):
        TransformersBackend.load(tmp_path, device="gpu7")


def test_num_logits_keeps_each_rows_last_tokens_and_bad_calls_change_nothing(make_backend):
    backend = make_backend(0)
    backend.reserve(3)
    for sequence_id in (1, 2):
        backend.prefill(sequence_id, [3, 1, 4])
    full = backend.forward([(1, [6]), (2, [7, 8, 9])])
    backend.rollback(1, 1)
    backend.rollback(2, 3)
    last_two = backend.forward([(1, [6]), (2, [7, 8, 9])], num_logits=2)
    assert [len(rows) for rows in last_two] == [1, 2]  # at most a row's own tokens
    assert torch.equal(last_two[0], full[0]) and torch.equal(last_two[1], full[1][-2:])
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_logits"):
            backend.forward([(1, [5])], num_logits=bad)
    assert backend.num_cached_tokens(1) == 4 and backend.num_cached_tokens(2) == 6
    with pytest.raises(ValueError, match="exceed"):  # a failed first prefill holds nothing
        backend.prefill(3, [1] * (backend.max_context_length + 1))
    with pytest.raises(ValueError, match="not held"):
        backend.num_cached_tokens(3)
