import numpy as np
import pytest

from datapipe.units import format_size, parse_size, percentiles


@pytest.mark.parametrize("text,value", [
    ("100", 100), ("4M", 4 << 20), ("512k", 512 << 10), ("1G", 1 << 30), ("2T", 2 << 40),
    ("4MB", 4 << 20), ("4MiB", 4 << 20), ("4 mib", 4 << 20), ("1.5K", 1536), ("1e6", 1_000_000), ("7B", 7),
])
def test_parse_size_units(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "4X", "-1M", "M", "nan", "inf", "1..5M"])
def test_parse_size_rejects_with_the_text_named(bad):
    with pytest.raises(ValueError, match=repr(bad).replace(".", r"\.")):
        parse_size(bad)


def test_parse_size_minimum():
    assert parse_size("0", minimum=0) == 0
    with pytest.raises(ValueError, match="at least 1 byte"):
        parse_size("0")
    with pytest.raises(TypeError):
        parse_size(4)


@pytest.mark.parametrize("n", [1, 1000, 1 << 10, 3 << 20, 5 << 30, 1 << 40, (1 << 20) + 1])
def test_format_size_round_trips(n):
    assert parse_size(format_size(n)) == n


def test_format_size_picks_the_largest_exact_unit():
    assert format_size(4 << 20) == "4M" and format_size(1536) == "1536" and format_size(2048) == "2K"


def test_percentiles_match_numpy_linear():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        values = rng.random(n).tolist()
        got = percentiles(values, scale=1e3)
        want = np.percentile(np.asarray(values) * 1e3, [50, 90, 99])
        assert [got["p50"], got["p90"], got["p99"]] == pytest.approx(want.tolist())


def test_percentiles_mean_rounding_and_empty():
    assert percentiles([0.001, 0.003], scale=1e3, digits=3, mean=True) == {"mean": 2.0, "p50": 2.0, "p90": 2.8,
                                                                             "p99": 2.98}
    assert percentiles([], mean=True) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert list(percentiles([1, 2], qs=(50, 90))) == ["p50", "p90"]
