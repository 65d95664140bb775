"""datapipe demo: its table has one unit per column, and its last lines say what to try next."""
import re

from datapipe.tools import demo


ROWS = [
    {"stage": "ShardStream (raw samples)", "batches": None, "samples": 200, "seconds": 0.5, "tokens": None},
    {"stage": "loaders.DataLoader (2 workers)", "batches": 4, "samples": 200, "seconds": 2.0, "tokens": None,
     "note": "a note"},
    {"stage": "loaders.TokenLoader (packed, 2048)", "batches": 10, "samples": 80, "seconds": 1.0,
     "tokens": 150_000, "note": "a sample is a packed row"},
]


def cells(line):
    return re.split(r"\s{2,}", line.strip())


def test_the_table_has_one_unit_per_column():
    header, *lines = demo.table(ROWS)
    assert cells(header)[:6] == ["stage", "batches", "samples", "seconds", "samples/s", "tokens/s"]
    stream, dataloader, tokens = (cells(line) for line in lines)
    assert stream[1:6] == ["-", "200", "0.50", "400", "-"]  # a bare stream yields samples: no batch count
    assert dataloader[1:6] == ["4", "200", "2.00", "100", "-"]
    assert tokens[1:6] == ["10", "80", "1.00", "80", "150,000"]
    assert "yielded" not in header


def test_stage_rows_count_batches_and_samples_apart():
    row = demo._timed("s", iter([[1, 2, 3], [4, 5]]), len)
    assert row["batches"] == 2 and row["samples"] == 5 and row["tokens"] is None
    row = demo._timed("s", iter("abc"), lambda s: 1, batched=False)
    assert row["batches"] is None and row["samples"] == 3


def test_the_demo_ends_with_what_to_try_next(tmp_path, monkeypatch, capsys):
    from datapipe.tools.synthetic import make_image_dataset

    make_image_dataset(str(tmp_path / "images"), num_images=4, num_classes=2, size=(16, 16), progress=False)
    for name in ("stage_stream", "stage_dataloader", "stage_images", "stage_tokens"):
        monkeypatch.setattr(demo, name, lambda *a, **k: dict(ROWS[1]))
    monkeypatch.setattr(demo, "make_token_shards", lambda *a, **k: [])
    assert demo.main(["--data", str(tmp_path), "--images", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[0].startswith("stage") and len([line for line in out if line.startswith("loaders.")]) == 4
    tail = out[-5:]
    assert tail[0].strip().startswith(f"datapipe inspect {tmp_path / 'images'}")
    for command in ("datapipe bench loader", "datapipe shard", "datapipe bench storage", "datapipe doctor --"):
        assert any(line.strip().startswith(command) for line in tail), command
