"""A compatibility record as the tiny model's P and D exchange it, for the wire and side-channel tests."""

from __future__ import annotations

from kv_connectors import wire

COMPAT = wire.CompatInfo(
    architecture="LlamaForCausalLM",
    num_layers=2,
    hidden_size=128,
    num_kv_heads=2,
    head_size=32,
    vocab_size=1024,
    dtype="torch.float32",
    block_size=32,
    layout=(32, 2, 16384, 16384),
)
