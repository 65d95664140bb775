"""A packed batch (document mask + position_ids) gives every document the logits and loss it gets alone."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from packing import Packer
from packing.batch import attention_mask_for_sdpa, to_torch


def rope(x, pos):
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=x.dtype) / half))
    ang = pos[:, None, :, None].to(x.dtype) * freqs  # [B, 1, L, half]
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, pos, mask):
        b, length, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, length, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rope(q, pos), rope(k, pos)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(att.transpose(1, 2).reshape(b, length, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids, pos, mask):
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x, pos, mask)
        return self.head(self.ln(x))


def alone(model, doc):
    ids = torch.as_tensor(doc)[None]
    n = ids.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    return model(ids, torch.arange(n)[None], causal)[0]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = TinyLM().double().eval()
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 64, n) for n in rng.integers(1, 30, 40)]
    packer = Packer(32, buffer_size=16, overflow="error")
    batches = [to_torch(b) for b in packer.batches(docs, 4)]
    return model, docs, batches


def packed_logits(model, batch, masked=True):
    mask = attention_mask_for_sdpa(batch["document_ids"]) if masked else \
        torch.ones(batch["input_ids"].shape[1], batch["input_ids"].shape[1], dtype=torch.bool).tril()
    return model(batch["input_ids"], batch["position_ids"], mask)


def test_logits_and_loss_match_each_document_alone(setup):
    model, docs, batches = setup
    by_tokens = {tuple(d.tolist()): d for d in docs}
    seen = 0
    packed_terms, alone_terms = [], []
    with torch.no_grad():
        for batch in batches:
            logits = packed_logits(model, batch)
            labels = batch["labels"]
            per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:],
                                        ignore_index=-100, reduction="none")
            for r in range(labels.shape[0]):
                doc_ids = batch["document_ids"][r]
                for d in range(int(doc_ids.max()) + 1):
                    where = torch.nonzero(doc_ids == d).flatten()
                    tokens = batch["input_ids"][r, where]
                    doc = by_tokens[tuple(tokens.tolist())]
                    ref = alone(model, doc)
                    torch.testing.assert_close(logits[r, where], ref, rtol=0, atol=1e-10)
                    # loss terms: predictions made from this document's tokens (shifted labels)
                    mine = per_token[r, where[:-1]]
                    ref_terms = F.cross_entropy(ref[:-1], torch.as_tensor(doc[1:]), reduction="none")
                    torch.testing.assert_close(mine, ref_terms, rtol=0, atol=1e-10)
                    packed_terms.append(mine)
                    alone_terms.append(ref_terms)
                    seen += 1
            # the prediction across a boundary and from padding is ignored
            valid = labels[:, 1:] != -100
            assert torch.isclose(per_token[valid].sum(), per_token.sum())
            assert int(valid.sum()) == int(((batch["document_ids"] >= 0).sum(1) - (batch["document_ids"].amax(1) + 1)).sum())
    assert seen == len(docs)
    torch.testing.assert_close(torch.cat(packed_terms).mean(), torch.cat(alone_terms).mean(), rtol=0, atol=1e-12)


def test_varlen_segments_from_cu_seqlens_give_the_same_logits(setup):
    model, _, batches = setup
    with torch.no_grad():
        for batch in batches[:3]:
            logits = packed_logits(model, batch).reshape(-1, 64)
            ids = batch["input_ids"].reshape(-1)
            pos = batch["position_ids"].reshape(-1)
            cu = batch["cu_seqlens"].tolist()
            for a, e in zip(cu[:-1], cu[1:]):
                assert pos[a:e].tolist() == list(range(e - a))
                causal = torch.ones(e - a, e - a, dtype=torch.bool).tril()[None, None]
                seg = model(ids[a:e][None], pos[a:e][None], causal)[0]
                torch.testing.assert_close(logits[a:e], seg, rtol=0, atol=1e-10)


def test_without_the_document_mask_later_documents_differ(setup):
    model, docs, batches = setup
    by_tokens = {tuple(d.tolist()): d for d in docs}
    with torch.no_grad():
        batch = next(b for b in batches if int(b["document_ids"].amax()) >= 1)
        logits = packed_logits(model, batch, masked=False)
        r = int(torch.nonzero(batch["document_ids"].amax(1) >= 1)[0])
        where = torch.nonzero(batch["document_ids"][r] == 1).flatten()
        doc = by_tokens[tuple(batch["input_ids"][r, where].tolist())]
        assert not torch.allclose(logits[r, where], alone(model, doc), atol=1e-6)
