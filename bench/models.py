"""The models the benchmark scripts train, as training steps, and the small transformer ``Block``.

``ImageStep``: ResNet-50 (random init), SGD, bf16 autocast, channels_last; a uint8 batch (NCHW or
NHWC) is normalised in the step. ``LlamaStep``: a Hugging Face Llama (~162M parameters, random
init) fed packed token batches. ``TokenStep``: the small causal LM ``PackedLM``. ``Block(d, heads)``:
``x + proj(attn(q, k, v))`` then ``x + mlp(ln2(x))``, with ``q, k, v`` of shape
``[B, L, heads, d // heads]`` (RoPE applied first when ``pos`` is given); ``sdpa(mask=, causal=)``
makes the usual attention callable.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["Block", "ImageStep", "LlamaStep", "PackedLM", "TokenStep", "rope", "sdpa"]

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


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


class ImageStep:
    """One SGD step of ``arch`` (torchvision, random init; a tiny CNN without torchvision), bf16 autocast on
    CUDA, channels_last. ``compile``: the model under ``torch.compile`` (True, or a mode such as
    ``"reduce-overhead"``); ``backend``: another dynamo backend instead of inductor and a mode. ``(images, labels)`` in: float
    NCHW images as they are, uint8 NCHW or NHWC normalised here with the ImageNet mean/std."""

    def __init__(self, device: torch.device, arch: str = "resnet50", num_classes: int = 1000, compile: bool | str = False,
                 backend: str | None = None):
        try:
            import torchvision

            model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
        except ImportError:
            model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(16, num_classes))
        self.device = device
        self.model = model.to(device, memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        mode = None if compile in (True, "default") else compile
        if compile and backend:  # another dynamo backend (e.g. "eager": a smoke check without inductor), no mode
            self.forward = torch.compile(self.model, backend=backend)
        else:
            self.forward = torch.compile(self.model, mode=mode) if compile else self.model
        self.loss_fn = nn.CrossEntropyLoss()
        self.mean = torch.tensor([m * 255 for m in MEAN], device=device).view(1, 3, 1, 1)
        self.std = torch.tensor([s * 255 for s in STD], device=device).view(1, 3, 1, 1)
        self.cuda = device.type == "cuda"

    def __call__(self, batch) -> None:
        x, y = batch
        if x.dtype == torch.uint8:
            if x.shape[-1] == 3:  # NHWC: a channels_last NCHW view
                x = x.permute(0, 3, 1, 2)
            x = (x.float() - self.mean) / self.std
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
            loss = self.loss_fn(self.forward(x), y.long())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


class TokenStep:
    """The small causal LM ``PackedLM`` (d 512, 6 layers, sdpa with the packed block mask), AdamW."""

    def __init__(self, device: torch.device, seq_len: int, small: bool = False):
        d, heads, layers, vocab = (64, 4, 1, 32000) if small else (512, 8, 6, 32000)
        self.device = device
        self.model = PackedLM(vocab=vocab, d=d, heads=heads, layers=layers, seq_len=seq_len).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def __call__(self, batch) -> None:
        from packing.batch import attention_mask_for_sdpa

        mask = attention_mask_for_sdpa(batch["document_ids"])
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.model(batch["input_ids"].long(), batch["position_ids"].long(), mask)
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                               batch["labels"][:, 1:].flatten().long(), ignore_index=-100)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


class LlamaStep:
    """A Hugging Face Llama (random init from a LlamaConfig, ~162M parameters; ``small``: a tiny one), bf16
    weights on CUDA, sdpa, AdamW. The packed batch goes in through ``packing.batch.hf_inputs`` (input_ids,
    position_ids, labels, no attention mask: transformers masks between packed documents by position ids)."""

    def __init__(self, device: torch.device, seq_len: int, small: bool = False):
        from transformers import LlamaConfig, LlamaForCausalLM

        size = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4) if small else
                dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12))
        config = LlamaConfig(vocab_size=32000, max_position_embeddings=seq_len, tie_word_embeddings=False,
                             attn_implementation="sdpa", **size)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
        self.model.train()
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def __call__(self, batch) -> None:
        from packing.batch import hf_inputs

        inputs = {k: v.long() if torch.is_tensor(v) else v for k, v in hf_inputs(batch).items()}
        loss = self.model(**inputs).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
