import io
import os
import socket

import numpy as np
import pytest
import torch

from dataclasses import fields

from datapipe import DataError, ShardStream, ShardWriter
from loaders import TokenLoader
from loaders.tokens.options import DocumentOptions, PackOptions
from tests.resume import assert_resumes_identically

STREAM = ("shuffle", "seed", "shuffle_buffer", "rank", "world_size", "on_error")


def tl(urls, **kw):
    """A TokenLoader from flat keyword arguments: the stream's settings build its ShardStream (as the loader's
    defaults would: shuffled, a 1000-document buffer), the rest go to their option group."""
    stream = {k: kw.pop(k) for k in STREAM if k in kw}
    packing = PackOptions(**{f.name: kw.pop(f.name) for f in fields(PackOptions) if f.name in kw})
    documents = DocumentOptions(**{f.name: kw.pop(f.name) for f in fields(DocumentOptions) if f.name in kw})
    source = urls
    if stream:
        shuffle = stream.pop("shuffle", True)
        buffer = stream.pop("shuffle_buffer", 1000)
        source = ShardStream(urls, shuffle=shuffle, shuffle_buffer=buffer if shuffle else 0, **stream)
    return TokenLoader(source, packing=packing, documents=documents, **kw)


def write_token_shards(directory, lengths, *, per_shard=25, text=False, bad=()):
    """Documents whose token values are globally unique: doc i holds i * 100000 + (0..n-1)."""
    with ShardWriter(os.path.join(directory, "tok-%04d.tar"), max_count=per_shard) as w:
        for i, n in enumerate(lengths):
            ids = (np.arange(n) + i * 100_000).astype(np.int32)
            if i in bad:
                w.write({"__key__": f"d{i:05d}", "npy": b"not an npy file"})
            elif text:
                w.write({"__key__": f"d{i:05d}", "txt": " ".join(map(str, ids.tolist()))})
            else:
                buf = io.BytesIO()
                np.save(buf, ids)
                w.write({"__key__": f"d{i:05d}", "npy": buf.getvalue()})
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".tar"))


def lengths(n, seed=0, high=300):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(3.5, 1.0, n).astype(int), 1, high).tolist()


def real_tokens(batch):
    if "document_ids" in batch:
        return batch["input_ids"][batch["document_ids"] >= 0]
    return batch["input_ids"][batch["attention_mask"] == 1]


def test_every_token_exactly_once_in_packed_rows(tmp_path):
    lens = lengths(120)
    urls = write_token_shards(tmp_path, lens)
    loader = tl(urls, seq_len=128, batch_size=4, buffer_size=64)
    batches = list(loader)
    got = torch.cat([real_tokens(b) for b in batches]).sort().values
    expected = torch.tensor(sorted(i * 100_000 + j for i, n in enumerate(lens) for j in range(n)))
    assert torch.equal(got, expected.to(got.dtype))
    assert all(b["input_ids"].shape[1] == 128 for b in batches)
    stats = loader.stats()
    assert stats["efficiency"] > 0.9 and stats["tokens"] == sum(lens)
    # no document that fits a row is split: its tokens sit contiguously in one row
    for b in batches:
        for row_ids, row_docs in zip(b["input_ids"], b["document_ids"]):
            for d in row_docs.unique():
                if d < 0:
                    continue
                toks = row_ids[row_docs == d]
                assert torch.equal(toks - toks[0], torch.arange(len(toks), dtype=toks.dtype))


def test_urls_get_a_shuffled_stream_and_a_given_stream_is_used_as_it_is(tmp_path):
    urls = write_token_shards(tmp_path, lengths(30))
    built = TokenLoader(urls, seq_len=128, batch_size=4)
    assert (built.stream.shuffle, built.stream.shuffle_buffer, built.stream.seed) == (True, 1000, 0)
    own = ShardStream(urls, seed=3, on_error="skip")
    assert TokenLoader(own, seq_len=128, batch_size=4).stream is own
    folder = TokenLoader(str(tmp_path), seq_len=128, batch_size=4, packing=PackOptions(buffer_size=8))
    assert sum(int(real_tokens(b).numel()) for b in folder) == sum(lengths(30))  # a folder: its shards


def test_a_decoded_stream_gives_the_same_batches(tmp_path):
    """A stream with .decode() steps hands over numpy arrays (npy) and str (txt): the loader takes those too."""
    urls = write_token_shards(tmp_path, lengths(20))
    raw = list(TokenLoader(ShardStream(urls), seq_len=64, batch_size=2))
    decoded = list(TokenLoader(ShardStream(urls).decode("pil"), seq_len=64, batch_size=2))
    assert len(raw) == len(decoded) and all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(raw, decoded))
    os.makedirs(tmp_path / "text")
    text = write_token_shards(tmp_path / "text", [3, 4], text=True)
    tokenizer = lambda s: [int(t) for t in s.split()]  # noqa: E731
    (batch,) = list(TokenLoader(ShardStream(text).decode("pil"), seq_len=16, batch_size=2, tokenizer=tokenizer))
    assert real_tokens(batch).numel() == 7


def test_bad_arguments_name_the_argument(tmp_path):
    import inspect

    urls = write_token_shards(tmp_path, lengths(5))
    assert len(inspect.signature(TokenLoader).parameters) <= 12
    with pytest.raises(TypeError, match="seq_len='128'"):
        TokenLoader(urls, seq_len="128", batch_size=4)
    with pytest.raises(ValueError, match="batch_size=0"):
        TokenLoader(urls, seq_len=128, batch_size=0)
    with pytest.raises(TypeError, match="packing="):
        TokenLoader(urls, seq_len=128, batch_size=4, packing={"eos_id": 2})
    for make in (lambda: PackOptions(batching="greedy"), lambda: PackOptions(eos_id=-1),
                 lambda: PackOptions(buffer_size=0), lambda: PackOptions(overflow="drop"),
                 lambda: DocumentOptions(token_dtype="float32")):
        with pytest.raises(ValueError):
            make()


def test_eos_id_ends_every_document(tmp_path):
    urls = write_token_shards(tmp_path, [5, 7, 3])
    (plain,) = list(TokenLoader(ShardStream(urls), seq_len=32, batch_size=2))
    (ended,) = list(TokenLoader(ShardStream(urls), seq_len=32, batch_size=2, packing=PackOptions(eos_id=99)))
    assert int((plain["input_ids"] == 99).sum()) == 0  # no EOS unless asked for
    assert int((ended["input_ids"] == 99).sum()) == 3 and real_tokens(ended).numel() == 15 + 3


def test_positions_restart_and_labels_mask_boundaries(tmp_path):
    urls = write_token_shards(tmp_path, [5, 7, 3])
    (batch,) = list(tl(urls, seq_len=16, batch_size=2, shuffle=False))
    pos, docs, labels = batch["position_ids"][0], batch["document_ids"][0], batch["labels"][0]
    starts = (pos == 0) & (docs >= 0)
    assert int(starts.sum()) == 3
    assert (labels[starts] == -100).all() and (labels[docs < 0] == -100).all()


@pytest.mark.parametrize("batching", ["packed", "dynamic"])
def test_resume_at_every_step(tmp_path, batching):
    urls = write_token_shards(tmp_path, lengths(60, seed=1, high=100))

    def make():
        return tl(urls, seq_len=100, batch_size=3, buffer_size=16, batching=batching, seed=4,
                           shuffle_buffer=8, max_tokens=400)

    same = lambda a, b: a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k]))
                                                      for k in a)
    full = assert_resumes_identically(make, same=same)
    assert len(full) > 3


def test_dynamic_batches_respect_the_budget(tmp_path):
    urls = write_token_shards(tmp_path, lengths(80, seed=2, high=200))
    for batch in tl(urls, seq_len=200, batch_size=16, batching="dynamic", max_tokens=512,
                             pad_to_multiple_of=8):
        b, l = batch["input_ids"].shape
        assert b * l <= 512 and l % 8 == 0


def test_text_with_a_tokenizer(tmp_path):
    urls = write_token_shards(tmp_path, [4, 6], text=True)
    tokenizer = lambda text: [int(t) for t in text.split()]
    (batch,) = list(tl(urls, seq_len=10, batch_size=1, tokenizer=tokenizer, shuffle=False))
    assert sorted(real_tokens(batch).tolist()) == [0, 1, 2, 3, 100000, 100001, 100002, 100003, 100004, 100005]
    with pytest.raises(DataError, match="tokenizer"):
        list(tl(urls, seq_len=10, batch_size=1))


def test_bad_documents_raise_or_are_counted(tmp_path):
    urls = write_token_shards(tmp_path, [5, 5, 5, 5], bad={2})
    with pytest.raises(DataError, match="d00002"):
        list(tl(urls, seq_len=16, batch_size=2))
    loader = tl(urls, seq_len=16, batch_size=2, on_error="skip")
    assert sum(len(real_tokens(b)) for b in loader) == 15
    assert loader.stats()["bad_documents"] == 1
    assert loader.stats()["producer"]["batches"] == loader.stats()["batches"]
    seen = []
    handled = tl(urls, seq_len=16, batch_size=2, on_error=seen.append)  # a handler that returns: skip
    assert sum(len(real_tokens(b)) for b in handled) == 15 and handled.stats()["bad_documents"] == 1
    assert [e.key for e in seen] == ["d00002"] and isinstance(seen[0], DataError)


def _ddp_worker(rank, world, port, urls, out):
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    loader = tl(urls, seq_len=64, batch_size=2, buffer_size=8)
    counts, dropped, firsts = [], 0, []
    for _ in range(2):  # two epochs, each reshuffled
        count = 0
        for batch in loader:
            t = torch.ones(1)
            torch.distributed.all_reduce(t)  # a training step's collective: hangs if ranks disagree
            firsts += [batch["input_ids"]] if count == 0 else []
            count += 1
        counts.append(count)
        dropped += loader.stats()["dropped_tail_batches"]
    torch.save({"batches": counts, "dropped": dropped, "firsts": firsts}, os.path.join(out, f"{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_ranks_yield_equal_batch_counts_under_ddp(tmp_path):
    # skewed lengths: the two ranks' documents pack into different numbers of rows
    lens = [60] * 20 + [3] * 20
    urls = write_token_shards(tmp_path / "d", lens, per_shard=20) if os.makedirs(tmp_path / "d") is None else None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(_ddp_worker, args=(2, port, urls, str(tmp_path)), nprocs=2, join=True,
                                          start_method="spawn")
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert results[0]["batches"] == results[1]["batches"] and min(results[0]["batches"]) > 0  # in every epoch
    assert any(not torch.equal(*r["firsts"]) for r in results)  # the second epoch is another order
    assert sum(r["dropped"] for r in results) > 0  # the longer rank really had more


@pytest.mark.gpu
def test_batches_on_the_gpu_equal_the_cpu_ones(tmp_path):
    urls = write_token_shards(tmp_path, lengths(50, seed=5))
    cpu = list(TokenLoader(urls, seq_len=128, batch_size=4))
    gpu = list(TokenLoader(urls, seq_len=128, batch_size=4, device="cuda"))
    assert len(cpu) == len(gpu)
    for a, b in zip(cpu, gpu):
        assert b["input_ids"].is_cuda and b["cu_seqlens"].is_cuda
        assert all(torch.equal(a[k].cpu() if torch.is_tensor(a[k]) else torch.as_tensor(a[k]),
                               b[k].cpu() if torch.is_tensor(b[k]) else torch.as_tensor(b[k])) for k in a)


@pytest.mark.parametrize("new_world", [2, 3, 1, 8])
def test_resume_on_another_world_size_packs_every_document_once(tmp_path, new_world):
    from collections import Counter

    from datapipe.order import elastic

    lens = lengths(150, seed=new_world, high=200)
    urls = write_token_shards(tmp_path, lens)
    kw = dict(seq_len=128, batch_size=2, buffer_size=16, shuffle_buffer=8, seed=4)
    tokens, states = [], []
    for r in range(4):
        loader = tl(urls, rank=r, world_size=4, **kw)
        it = iter(loader)
        for _ in range(3):  # the producer runs ahead: batches sit prefetched at the checkpoint
            tokens += real_tokens(next(it)).tolist()
        states.append(loader.state_dict())
        del it
    g = elastic.merge_states(states)
    assert elastic.shape(g) == {"world_size": 4, "num_workers": 1}
    assert sum(len(s["batcher"]["buffer"]["lengths"]) + len(s["batcher"]["ready"]["lengths"]) for s in states) > 0
    for r in range(new_world):
        loader = tl(urls, rank=r, world_size=new_world, **kw)
        loader.load_state_dict(g)
        tokens += [t for b in loader for t in real_tokens(b).tolist()]
        assert loader.stats()["stream"]["resumed_from"] == {"world_size": 4, "num_workers": 1}
    seen = Counter(tokens)
    per_doc = {}
    for t, n in seen.items():
        per_doc.setdefault(t // 100_000, set()).add(n)
    assert set(per_doc) == set(range(len(lens))) and len(seen) == sum(lens)  # every token of every document
    assert all(len(ns) == 1 for ns in per_doc.values())  # whole documents only, never a part twice
    assert sum(ns.pop() - 1 for ns in per_doc.values()) <= 3 + new_world - 1  # only the plans' padding repeats


def test_a_new_pass_stops_the_last_one_first(tmp_path):
    urls = write_token_shards(tmp_path, lengths(120))
    loader = tl(urls, seq_len=128, batch_size=4, buffer_size=64)
    ref = torch.cat([real_tokens(b) for b in loader]).sort().values
    old = iter(loader)
    next(old)  # its producer thread runs ahead on the stream both passes share
    assert torch.equal(torch.cat([real_tokens(b) for b in loader]).sort().values, ref)
    with pytest.raises(StopIteration):
        next(old)


def test_stats_describe_the_last_pass(tmp_path):
    """batches, tokens, wait and elapsed time all restart with a pass: its rates stay rates of that pass."""
    lens = lengths(80)
    loader = tl(write_token_shards(tmp_path, lens), seq_len=128, batch_size=4, buffer_size=64)
    next(iter(loader))  # an abandoned pass
    for _ in range(2):
        n = sum(1 for _ in loader)
        stats = loader.stats()
        assert stats["batches"] == n and stats["tokens"] == sum(lens)
        assert 0.0 <= stats["wait_fraction"] <= 1.0
        assert stats["tokens_per_s"] == stats["tokens"] / stats["elapsed_s"]


@pytest.mark.parametrize("batching", ["packed", "dynamic"])
def test_stats_scopes_are_the_pass_the_epoch_and_the_stream_as_documented(tmp_path, batching):
    """docs/loaders.md's table: bad_documents, tokens and rates are the pass's; batches and the batcher's counters
    the epoch's (a resume restores them); only `stream` counts since the stream was made."""
    urls = write_token_shards(tmp_path, [5] * 20, bad={2})
    make = lambda: tl(urls, seq_len=16, batch_size=2, on_error="skip", batching=batching, shuffle=False)
    loader = make()
    passes = []
    for _ in range(2):
        n = sum(1 for _ in loader)
        passes.append(loader.stats())
        st = passes[-1]
        assert st["bad_documents"] == 1 and st["tokens"] == st["tokens_out"] == 19 * 5  # not 2 on the second pass
        assert st["batches"] == st["batches_out"] == n and st["dropped_tail_batches"] == 0
    key = "documents_in" if batching == "packed" else "sequences_in"
    assert passes[0][key] == passes[1][key] == 19
    assert passes[1]["stream"]["samples"] == 2 * passes[0]["stream"]["samples"] == 2 * 20
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    state = loader.state_dict()
    del it
    again = make()
    again.load_state_dict(state)
    rest = sum(1 for _ in again)
    st = again.stats()
    assert st["batches"] == 3 + rest == passes[0]["batches"]  # the epoch's, the resumed batches included
    assert st["tokens"] == 19 * 5 - sum(len(real_tokens(b)) for b in first)  # this pass's only
