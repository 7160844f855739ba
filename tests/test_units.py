import pytest

from memest.device.fit import fit_rows, resolve_budget
from memest.device.nvml import Gpu, GpuQuery
from memest.errors import MemestError
from memest.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    "text,expected",
    [("11GB", 11 * 10**9), ("11GiB", 11 * 2**30), ("11000MiB", 11000 * 2**20), ("1.5GiB", 3 * 2**29), ("512", 512)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["11XB", "GB", "-1GB", "eleven", ""])
def test_parse_bytes_rejects(text):
    with pytest.raises(MemestError, match="11GB"):
        parse_bytes(text)


def test_negative_budget_says_so():
    with pytest.raises(MemestError, match="below zero"):
        parse_bytes("-1GB")


def test_format_bytes_binary_units():
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(100) == "100 B"


def test_resolve_budget_kinds():
    assert resolve_budget("0") == 0
    label, n = resolve_budget("rtx2080ti")
    assert n == 11 * 2**30 and "rtx2080ti" in label
    assert resolve_budget("11GB") == ("11GB", 11 * 10**9)
    with pytest.raises(MemestError, match="known card"):
        resolve_budget("rtx9999")


def test_fit_against_budget_and_devices():
    (row,) = fit_rows(10 * 10**9, "11GB", None)
    assert row.fits and row.headroom_bytes == 10**9
    (row,) = fit_rows(12 * 10**9, "11GB", None)
    assert not row.fits and row.headroom_bytes == -(10**9)
    query = GpuQuery([Gpu(0, "Fake GPU", 16 * 2**30, 6 * 2**30, 10 * 2**30), Gpu(1, "Other", 8 * 2**30, 0, 8 * 2**30)])
    rows = fit_rows(9 * 2**30, None, query)
    assert [r.fits for r in rows] == [True, False]
    (row,) = fit_rows(9 * 2**30, "1", query)
    assert row.label.startswith("GPU 1") and not row.fits
    with pytest.raises(MemestError, match="no such GPU"):
        fit_rows(1, "3", query)
    assert fit_rows(1, None, GpuQuery([], "no driver")) == []
