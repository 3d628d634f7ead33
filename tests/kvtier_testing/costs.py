"""A model whose cost figures are easy to work out by hand, for the time-and-money tests."""

from __future__ import annotations

# config.json fields of a one-layer model: 1 layer x 2 x 1 KV head x 8 dims x 4 bytes = 64 B/token.
TINY = {
    "num_hidden_layers": 1,
    "hidden_size": 8,
    "intermediate_size": 8,
    "num_attention_heads": 1,
    "vocab_size": 0,
    "torch_dtype": "float32",
}
