"""datapipe.tools.plots: the PNGs drawn from benchmark results."""
import pytest

pytest.importorskip("matplotlib")

from datapipe.tools.plots import plot_worker_shm  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _png(path):
    with open(path, "rb") as f:
        return f.read(8) == PNG


def test_worker_shm_plot_draws_two_cases(tmp_path):
    rows = [{"spin_ms": spin, "variant": v, "batches_per_s": rate, "vs_torch": rate / 100}
            for spin in (0.0, 40.0) for v, rate in (("torch", 100.0), ("dl_ours", 300.0))]
    path = plot_worker_shm({"gpu": None, "rows": rows}, str(tmp_path / "w.png"))
    assert _png(path)
