"""Sequence packing benchmark: efficiency and speed of packing vs padding, and GPU training throughput.

CPU part (always):
  * offline ``pack_lengths`` (bfd / ffd / spfhp) on log-normal lengths and on a real corpus (the
    .py files of an installed package, byte-level tokens), against pad-to-max (one document per
    row) and greedy concatenation (dense, but cuts documents at row boundaries);
  * the online ``Packer`` (bounded buffer) efficiency, docs/s and tokens/s (batches included);
  * padding fraction and batches/tokens per second of fixed-size batching vs ``TokenBudgetBatcher``
    vs packing, for encoder-style sequences.
GPU part (``--device cuda``): (i) a causal LM (6 layers, d=512, bf16) trained for a fixed number of
real tokens on padded batches vs packed batches (SDPA with the document mask; varlen flash
attention when torch has it; plain causal over packed rows as a reference that leaks across
documents); (ii) an encoder (bf16) on fixed-size padded batches vs TokenBudgetBatcher batches.

Results go to bench/results/packing.json under the device key ("cpu" or "cuda").
Usage: python bench/packing.py [--quick] [--device cuda]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packing import Packer, TokenBudgetBatcher, pack_lengths  # noqa: E402
from packing.algorithms import ALGORITHMS  # noqa: E402


# ---------------------------------------------------------------------------------- data
def lognormal_lengths(n, *, mu, sigma, seed=0, cap=None):
    lengths = np.maximum(1, np.random.default_rng(seed).lognormal(mu, sigma, n).astype(np.int64))
    return np.minimum(lengths, cap) if cap else lengths


def corpus_documents(package: str, limit: int | None = None) -> list[np.ndarray]:
    """The .py/.txt files of an installed package as byte-level token arrays (ids 0..255)."""
    import importlib

    root = Path(importlib.import_module(package).__file__).parent
    files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".txt", ".pyi") and p.is_file())
    docs = []
    for p in files[:limit]:
        data = p.read_bytes()
        if data:
            docs.append(np.frombuffer(data, dtype=np.uint8).astype(np.int64))
    return docs


def synthetic_documents(lengths, seed=1):
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 32000, int(lengths.max()) + 1)
    return [pool[:n] for n in lengths.tolist()]


# ---------------------------------------------------------------------------------- CPU part
def offline(lengths: np.ndarray, cap: int) -> dict:
    out = {"documents": int(lengths.size), "tokens": int(lengths.sum()),
           "lower_bound_rows": int(math.ceil(lengths.sum() / cap))}
    for algorithm in ALGORITHMS:
        t = time.perf_counter()
        bins = pack_lengths(lengths, cap, algorithm=algorithm)
        dt = time.perf_counter() - t
        out[algorithm] = {"rows": len(bins), "efficiency": lengths.sum() / (len(bins) * cap),
                          "seconds": dt, "lengths_per_s": lengths.size / dt}
    out["pad_to_max"] = {"rows": int(lengths.size), "efficiency": lengths.mean() / cap}
    ends = np.cumsum(lengths)
    starts = ends - lengths
    cut = (starts // cap) != ((ends - 1) // cap)
    out["greedy_concat"] = {"rows": int(math.ceil(lengths.sum() / cap)),
                            "efficiency": lengths.sum() / (math.ceil(lengths.sum() / cap) * cap),
                            "documents_split_fraction": float(cut.mean())}
    return out


def online(docs: list, seq_len: int, buffer_size: int, batch_size: int = 8) -> dict:
    packer = Packer(seq_len, buffer_size=buffer_size, overflow="split")
    t = time.perf_counter()
    for _ in packer.batches(docs, batch_size):
        pass
    dt = time.perf_counter() - t
    s = packer.stats()
    return {"buffer_size": buffer_size, "efficiency": s["efficiency"], "rows": s["rows_out"],
            "seconds": dt, "docs_per_s": s["documents_in"] / dt, "tokens_per_s": s["tokens_out"] / dt,
            "pieces_from_splits": s["pieces"] - s["documents_in"] + s["empty_documents"]}


def fixed_batches(seqs, batch_size, pad_to=None):
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i:i + batch_size]
        length = pad_to or max(len(s) for s in chunk)
        ids = np.zeros((len(chunk), length), dtype=np.int64)
        mask = np.zeros_like(ids)
        for r, s in enumerate(chunk):
            ids[r, :len(s)] = s
            mask[r, :len(s)] = 1
        yield {"input_ids": ids, "attention_mask": mask}


def batching_comparison(seqs: list, max_len: int, max_tokens: int) -> dict:
    """Padding fraction and CPU batch production rate of the three strategies."""
    out = {"sequences": len(seqs), "max_len": max_len, "max_tokens": max_tokens}
    batch_size = max_tokens // max_len
    real = sum(len(s) for s in seqs)
    for name, make in (
        ("fixed_pad_to_max_len", lambda: fixed_batches(seqs, batch_size, pad_to=max_len)),
        ("fixed_pad_to_batch_max", lambda: fixed_batches(seqs, batch_size)),
        ("token_budget", lambda: TokenBudgetBatcher(max_tokens, buffer_size=4096).batches(seqs)),
    ):
        t = time.perf_counter()
        total = nb = 0
        for b in make():
            total += b["input_ids"].size
            nb += 1
        dt = time.perf_counter() - t
        out[name] = {"batches": nb, "padding_fraction": 1 - real / total,
                     "tokens_per_s": real / dt, "batches_per_s": nb / dt}
    packer = Packer(max_len, buffer_size=4096)
    t = time.perf_counter()
    nb = sum(1 for _ in packer.batches(seqs, batch_size))
    dt = time.perf_counter() - t
    s = packer.stats()
    out["packing"] = {"batches": nb, "padding_fraction": s["padding_fraction"],
                      "tokens_per_s": s["tokens_out"] / dt, "batches_per_s": nb / dt}
    return out


def cpu_part(args) -> dict:
    res = {"lognormal": {}, "corpus": {}}
    n = 100_000 if args.quick else args.lengths
    for cap in args.seq_lens:
        lengths = lognormal_lengths(n, mu=args.mu, sigma=args.sigma, cap=cap)
        res["lognormal"][str(cap)] = {"offline": offline(lengths, cap)}
    n_docs = 20_000 if args.quick else args.stream_docs
    stream = synthetic_documents(lognormal_lengths(n_docs, mu=args.mu, sigma=args.sigma, seed=2))
    for cap in args.seq_lens:
        res["lognormal"][str(cap)]["online"] = [online(stream, cap, b) for b in args.buffers]
    docs = corpus_documents(args.corpus, limit=300 if args.quick else None)
    lengths = np.array([len(d) for d in docs])
    res["corpus"]["package"] = args.corpus
    res["corpus"]["documents"] = len(docs)
    res["corpus"]["median_length"] = float(np.median(lengths))
    for cap in args.seq_lens:
        res["corpus"][str(cap)] = {"offline": offline(np.minimum(lengths, cap), cap),
                                   "online": online(docs, cap, args.buffers[-1])}
    enc = synthetic_documents(lognormal_lengths(20_000 if args.quick else 100_000, mu=4.6,
                                                sigma=0.8, seed=3, cap=512))
    res["batching"] = batching_comparison(enc, 512, 512 * 64)
    res["token_loader"] = token_loader_throughput(stream[: 5_000 if args.quick else 40_000], args.seq_lens[0])
    return res


def token_loader_throughput(docs: list, seq_len: int) -> dict:
    """loaders.TokenLoader end to end on one process (read shards, decode npy, pack, tensors): tokens/s."""
    import io
    import tempfile

    from datapipe import ShardStream, ShardWriter
    from loaders import PackOptions, TokenLoader

    with tempfile.TemporaryDirectory() as tmp:
        with ShardWriter(os.path.join(tmp, "tok-%05d.tar"), max_count=2000) as writer:
            for i, doc in enumerate(docs):
                buf = io.BytesIO()
                np.save(buf, np.asarray(doc, dtype=np.int32))
                writer.write({"__key__": f"{i:08d}", "npy": buf.getvalue()})
        urls = sorted(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".tar"))
        best = None
        for _ in range(2):
            loader = TokenLoader(ShardStream(urls, shuffle=True), seq_len=seq_len, batch_size=8,
                                 packing=PackOptions(buffer_size=2048))
            t0 = time.perf_counter()
            tokens = sum(int((b["document_ids"] >= 0).sum()) for b in loader)
            dt = time.perf_counter() - t0
            if best is None or dt < best[1]:
                best = (tokens, dt, loader.stats())
    tokens, dt, stats = best
    return {"documents": len(docs), "seq_len": seq_len, "tokens": tokens, "seconds": dt,
            "tokens_per_s": tokens / dt, "efficiency": stats["efficiency"], "target_tokens_per_s": 5e6}


# ---------------------------------------------------------------------------------- GPU part
def gpu_part(args) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from bench.models import Block, sdpa
    from packing.batch import attention_mask_for_sdpa, to_torch

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tiny = args.quick
    d, layers, heads, vocab = (64, 2, 4, 512) if tiny else (512, 6, 8, 32768)
    seq_len = 256 if tiny else args.lm_seq_len
    rows = 4 if tiny else args.lm_rows
    lm_tokens = 20_000 if tiny else args.lm_tokens
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None

    class Model(nn.Module):
        def __init__(self, causal=True):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

        def forward(self, ids, pos, attn):
            x = self.emb(ids)
            for blk in self.blocks:
                x = blk(x, attn, pos)
            return self.head(self.ln(x))

    def varlen(cu, max_len):
        def attn(q, k, v):
            b, length, h, dh = q.shape
            o = varlen_attn(q.reshape(-1, h, dh), k.reshape(-1, h, dh), v.reshape(-1, h, dh),
                            cu, cu, max_len, max_len, window_size=(-1, 0))
            return o.view(b, length, h, dh)
        return attn

    def train(batches, step_fn, budget) -> dict:
        torch.manual_seed(0)
        model = Model().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        real = steps = 0
        t0 = None
        for i, batch in enumerate(batches):
            if i == 3:  # warm-up steps excluded
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0, real = time.perf_counter(), 0
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                loss = step_fn(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            real += int((batch["labels"] != -100).sum())
            steps += 1
            if t0 is not None and real >= budget:
                break
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return {"real_tokens": real, "seconds": dt, "real_tokens_per_s": real / dt, "steps": steps}

    def lm_loss(logits, labels):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)

    n_docs = max(2000, int(lm_tokens * 4 / math.exp(args.mu + args.sigma ** 2 / 2)))
    lengths = lognormal_lengths(n_docs, mu=args.mu, sigma=args.sigma, seed=5)
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, vocab, n) for n in lengths.tolist()]
    pieces = [doc[i:i + seq_len] for doc in docs for i in range(0, len(doc), seq_len)]

    def padded_batches():
        while True:
            for i in range(0, len(pieces) - rows + 1, rows):
                chunk = pieces[i:i + rows]
                length = -(-max(len(p) for p in chunk) // 64) * 64
                ids = np.zeros((rows, length), dtype=np.int64)
                labels = np.full((rows, length), -100, dtype=np.int64)
                for r, p in enumerate(chunk):
                    ids[r, :len(p)] = p
                    labels[r, 1:len(p)] = p[1:]
                pos = np.broadcast_to(np.arange(length), ids.shape).copy()
                yield {k: torch.from_numpy(v).to(device, non_blocking=True)
                       for k, v in (("input_ids", ids), ("labels", labels), ("position_ids", pos))}

    def packed_batches():
        while True:
            for b in Packer(seq_len, buffer_size=2048).batches(docs, rows):
                if len(b["input_ids"]) == rows:
                    yield to_torch(b, device)

    def step_padded(model, b):
        return lm_loss(model(b["input_ids"], b["position_ids"], sdpa(causal=True)), b["labels"])

    def step_packed_mask(model, b):
        mask = attention_mask_for_sdpa(b["document_ids"])
        return lm_loss(model(b["input_ids"], b["position_ids"], sdpa(mask=mask)), b["labels"])

    def step_packed_causal(model, b):
        return lm_loss(model(b["input_ids"], b["position_ids"], sdpa(causal=True)), b["labels"])

    def step_packed_varlen(model, b):
        attn = varlen(b["cu_seqlens"], int(b["max_seqlen"]))
        return lm_loss(model(b["input_ids"], b["position_ids"], attn), b["labels"])

    res = {"lm": {"layers": layers, "d_model": d, "vocab": vocab, "seq_len": seq_len,
                  "rows_per_batch": rows, "real_token_budget": lm_tokens, "dtype": str(dtype)}}
    variants = [("padded_causal", padded_batches, step_padded),
                ("packed_sdpa_doc_mask", packed_batches, step_packed_mask),
                ("packed_causal_leaky_reference", packed_batches, step_packed_causal)]
    if varlen_attn is not None and device.type == "cuda":
        variants.append(("packed_varlen_flash", packed_batches, step_packed_varlen))
    for name, make, step in variants:
        try:
            res["lm"][name] = train(make(), step, lm_tokens)
        except Exception as e:  # report, keep the other variants
            res["lm"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(f"lm {name}: {res['lm'][name]}", flush=True)

    # (ii) encoder: fixed-size padded batches vs token-budget batches
    max_len, bsz = (128, 8) if tiny else (512, 64)
    enc_tokens = 20_000 if tiny else args.enc_tokens
    enc_lengths = lognormal_lengths(max(4000, enc_tokens // 50), mu=4.6, sigma=0.8, seed=6, cap=max_len)
    seqs = [rng.integers(1, vocab, n) for n in enc_lengths.tolist()]

    def enc_fixed():
        while True:
            for b in fixed_batches(seqs, bsz, pad_to=max_len):
                yield _enc_batch(b)

    def enc_budget():
        while True:
            for b in TokenBudgetBatcher(bsz * max_len, buffer_size=4096).batches(seqs):
                yield _enc_batch(b)

    def _enc_batch(b):
        ids = torch.from_numpy(b["input_ids"]).to(device)
        mask = torch.from_numpy(b["attention_mask"]).to(device)
        return {"input_ids": ids, "mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    def step_enc(model, b):
        keep = b["mask"].bool()[:, None, None, :]
        pos = torch.arange(b["input_ids"].shape[1], device=device).expand_as(b["input_ids"])
        logits = model(b["input_ids"], pos, sdpa(mask=keep))
        return F.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten(), ignore_index=-100)

    res["encoder"] = {"max_len": max_len, "fixed_batch_size": bsz, "max_tokens": bsz * max_len,
                      "real_token_budget": enc_tokens}
    for name, make in (("fixed_padded", enc_fixed), ("token_budget", enc_budget)):
        try:
            res["encoder"][name] = train(make(), step_enc, enc_tokens)
        except Exception as e:
            res["encoder"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(f"encoder {name}: {res['encoder'][name]}", flush=True)
    return res


# ---------------------------------------------------------------------------------- main
def meta(args) -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "args": vars(args), "device_name": "cpu"}
    try:
        import torch

        info["torch"] = torch.__version__
        if args.device.startswith("cuda") and torch.cuda.is_available():
            info["device_name"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


def print_table(res: dict) -> None:
    print("\n== offline packing, efficiency (seconds) ==")
    for src in ("lognormal", "corpus"):
        for cap, r in res["cpu"][src].items():
            if not isinstance(r, dict) or "offline" not in r:
                continue
            o = r["offline"]
            cells = "  ".join(f"{a}={o[a]['efficiency']:.4f} ({o[a]['seconds']:.2f}s)" for a in ALGORITHMS)
            print(f"{src:9s} L={cap:5s} n={o['documents']:8d}  {cells}  pad_to_max={o['pad_to_max']['efficiency']:.3f}"
                  f"  greedy_concat={o['greedy_concat']['efficiency']:.4f}"
                  f" (splits {o['greedy_concat']['documents_split_fraction']:.1%} of docs)")
    print("\n== online Packer ==")
    for src in ("lognormal", "corpus"):
        for cap, r in res["cpu"][src].items():
            if not isinstance(r, dict) or "online" not in r:
                continue
            for o in (r["online"] if isinstance(r["online"], list) else [r["online"]]):
                print(f"{src:9s} L={cap:5s} buffer={o['buffer_size']:5d}  efficiency={o['efficiency']:.4f}"
                      f"  {o['docs_per_s']:,.0f} docs/s  {o['tokens_per_s'] / 1e6:,.1f} M tokens/s")
    t = res["cpu"].get("token_loader")
    if t:
        print(f"\n== loaders.TokenLoader (one process) ==\nL={t['seq_len']}  {t['tokens_per_s'] / 1e6:,.1f} M tokens/s"
              f"  efficiency={t['efficiency']:.4f}  (target >= 5 M tokens/s)")
    print("\n== batching (encoder-style, max_len 512) ==")
    for name, o in res["cpu"]["batching"].items():
        if isinstance(o, dict):
            print(f"{name:24s} padding={o['padding_fraction']:.3f}  {o['tokens_per_s'] / 1e6:,.1f} M real tokens/s (CPU)")
    if "gpu" in res:
        print("\n== GPU training, real tokens/s ==")
        for part in ("lm", "encoder"):
            for name, o in res["gpu"][part].items():
                if isinstance(o, dict):
                    print(f"{part:8s} {name:30s} " + (f"{o['real_tokens_per_s']:,.0f}" if "real_tokens_per_s" in o else o["error"]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda adds the training part)")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    p.add_argument("--train", action="store_true", help="run the training part on CPU too (with --quick)")
    p.add_argument("--lengths", type=int, default=1_000_000, help="lengths for offline packing")
    p.add_argument("--stream-docs", type=int, default=200_000, help="documents for the online Packer")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--buffers", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--mu", type=float, default=6.5, help="log-normal mean of log length")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of log length")
    p.add_argument("--corpus", default="numpy", help="installed package whose files form the corpus")
    p.add_argument("--lm-seq-len", type=int, default=4096)
    p.add_argument("--lm-rows", type=int, default=8)
    p.add_argument("--lm-tokens", type=int, default=3_000_000, help="real tokens per LM variant")
    p.add_argument("--enc-tokens", type=int, default=4_000_000, help="real tokens per encoder variant")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "packing.json"))
    args = p.parse_args(argv)

    res = {"meta": meta(args), "cpu": cpu_part(args)}
    if args.device.startswith("cuda") or args.train:
        res["gpu"] = gpu_part(args)
    key = "cuda" if args.device.startswith("cuda") else "cpu"
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    data[key] = res
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, default=float) + "\n")
    print_table(res)
    print(f"\nwrote {out} [{key}]")


if __name__ == "__main__":
    main()
