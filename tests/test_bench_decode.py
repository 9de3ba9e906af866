"""bench.decode's argument handling (CPU): the cases it parses and what --sweep-gemv accepts."""
import pytest

from bench import decode


def test_parse_cases():
    assert decode.parse_cases("1x1024,64x1k,1x32K") == [(1, 1024), (64, 1024), (1, 32768)]


def test_sweep_gemv_cases():
    assert decode.parse_args(["--sweep-gemv"]).cases == [(1, 1024), (8, 1024)]
    assert decode.parse_args(["--sweep-gemv", "--cases", "4x2k"]).cases == [(4, 2048)]
    assert decode.parse_args([]).cases == decode.CASES
    with pytest.raises(SystemExit):  # more rows than the GEMV takes: nothing of it to tune
        decode.parse_args(["--sweep-gemv", "--cases", "1x1024,64x1024"])
