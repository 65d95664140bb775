"""Hugging Face transformers on TokenLoader's packed batches: hf_inputs gives exact per-document loss."""
import io
import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[test])")

from datapipe import ShardWriter  # noqa: E402
from loaders import TokenLoader  # noqa: E402
from loaders.tokens.options import PackOptions  # noqa: E402
from packing.batch import hf_inputs  # noqa: E402

VOCAB = 48


def write_docs(directory, docs):
    with ShardWriter(os.path.join(directory, "tok-%04d.tar"), max_count=8) as w:
        for i, doc in enumerate(docs):
            buf = io.BytesIO()
            np.save(buf, np.asarray(doc, dtype=np.int32))
            w.write({"__key__": f"d{i:04d}", "npy": buf.getvalue()})
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".tar"))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = transformers.LlamaForCausalLM(cfg).double().eval()
    m.config._attn_implementation = "sdpa"
    return m


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, VOCAB, n).tolist() for n in rng.integers(2, 20, 14)]
    urls = write_docs(str(tmp_path_factory.mktemp("tok")), docs)
    batches = list(TokenLoader(urls, seq_len=32, batch_size=2, packing=PackOptions(buffer_size=8)))
    return docs, batches


def test_packed_loss_is_token_weighted_mean_of_document_losses(model, packed):
    docs, batches = packed
    by_tokens = {tuple(d): d for d in docs}
    seen = 0
    with torch.no_grad():
        for batch in batches:
            got = model(**hf_inputs(batch)).loss
            total, count = 0.0, 0
            for r in range(batch["input_ids"].shape[0]):
                ids, doc_ids = batch["input_ids"][r], batch["document_ids"][r]
                for d in range(int(doc_ids.max()) + 1):
                    doc = by_tokens[tuple(ids[doc_ids == d].tolist())]
                    x = torch.tensor([doc])
                    total += float(model(input_ids=x, labels=x, use_cache=False).loss) * (len(doc) - 1)
                    count += len(doc) - 1
                    seen += 1
            assert float(got) == pytest.approx(total / count, rel=1e-6)  # HF computes the loss in float32
    assert seen == len(docs)


def test_with_a_cache_documents_leak_into_each_other(model, packed):
    _, batches = packed
    batch = next(b for b in batches if int(b["document_ids"].max()) >= 1)
    kw = hf_inputs(batch)
    with torch.no_grad():
        exact = model(**kw).loss
        kw["use_cache"] = True  # transformers skips packed-sequence detection when it has a cache
        leaky = model(**kw).loss
    assert abs(float(exact) - float(leaky)) > 1e-3


def test_hf_inputs_contract():
    batch = {"input_ids": np.zeros((1, 4), np.int64), "position_ids": np.arange(4)[None], "labels": np.zeros((1, 4), np.int64)}
    kw = hf_inputs(batch)
    assert set(kw) == {"input_ids", "position_ids", "labels", "use_cache"} and kw["use_cache"] is False
    assert all(isinstance(kw[k], torch.Tensor) for k in ("input_ids", "position_ids", "labels"))
    with pytest.raises(ValueError, match="position_ids"):
        hf_inputs({"input_ids": batch["input_ids"], "labels": batch["labels"]})
