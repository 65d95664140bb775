"""The small transformer the benchmark scripts train: one pre-LN ``Block``, attention given per call.

``Block(d, heads)``: ``x + proj(attn(q, k, v))`` then ``x + mlp(ln2(x))``, with ``q, k, v`` of shape
``[B, L, heads, d // heads]`` (RoPE applied first when ``pos`` is given). ``sdpa(mask=, causal=)``
makes the usual attention callable. ``PackedLM`` is the causal LM of bench/scaling.py and
bench/ceiling.py (learned positions, sdpa with the packed block mask); bench/packing.py builds its
RoPE model from the same ``Block``.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["Block", "PackedLM", "rope", "sdpa"]


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (last dim split in halves) at integer positions ``pos``."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    ang = pos[..., None].float() * freqs
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def sdpa(mask: torch.Tensor | None = None, causal: bool = False):
    """Attention ``(q, k, v) -> o`` over ``[B, L, H, Dh]`` through ``scaled_dot_product_attention``."""
    def attn(q, k, v):
        o = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       attn_mask=mask, is_causal=causal)
        return o.transpose(1, 2)
    return attn


class Block(nn.Module):
    """Pre-LN transformer block of width ``d`` with ``heads`` attention heads and a 4x MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.d, self.heads = d, heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, attn, pos: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)  # [B, L, H, Dh]
        if pos is not None:
            q, k = rope(q, pos[:, :, None]), rope(k, pos[:, :, None])
        x = x + self.proj(attn(q, k, v).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))


class PackedLM(nn.Module):
    """Causal LM over packed rows: token + learned position embeddings, ``layers`` Blocks, a linear head."""

    def __init__(self, *, vocab: int, d: int, heads: int, layers: int, seq_len: int):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.emb(ids) + self.pos(positions)
        attn = sdpa(mask=mask)
        for block in self.blocks:
            x = block(x, attn)
        return self.head(x)
