"""cli/flags.py's bounded types: argparse refuses a value out of range with the range and its unit, and
takes both ends."""
import argparse

import pytest

from kvtrace.cli.flags import bounded, bounded_int, bounded_size


@pytest.mark.parametrize("text, value", [("0", 0.0), ("86400", 86400.0), ("0.5", 0.5), (" 12 ", 12.0)])
def test_bounded_takes_both_ends(text, value):
    assert bounded(0, 24 * 3600, "seconds")(text) == value


@pytest.mark.parametrize("text", ["-1", "86400.5", "nan", "inf", "-inf", "", "x", "1e400"])
def test_bounded_refuses_the_rest_naming_range_and_unit(text):
    with pytest.raises(argparse.ArgumentTypeError) as raised:
        bounded(0, 24 * 3600, "seconds")(text)
    assert str(raised.value) == f"takes 0 to 86400 seconds (1 day), not {text!r}"


def test_bounded_above_leaves_out_its_low_end():
    above = bounded(0, 1e12, "bytes per second", above=True)
    assert above("1e12") == 1e12 and above("0.001") == 0.001
    with pytest.raises(argparse.ArgumentTypeError, match="takes more than 0 and at most 1e12 bytes per second"):
        above("0")


@pytest.mark.parametrize("text, ok", [("1", True), ("65536", True), ("+7", True), ("0", False), ("65537", False),
                                      ("1.5", False), ("²", False), ("1_000", False), ("-1", False), ("", False)])
def test_bounded_int_takes_whole_numbers_in_range(text, ok):
    whole = bounded_int(1, 65536)
    if ok:
        assert whole(text) == int(text)
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=r"takes a whole number from 1 to 65536, not "):
            whole(text)


def test_bounded_int_says_what_zero_means():
    with pytest.raises(argparse.ArgumentTypeError, match=r"from 0 \(no limit\) to 100, not '-1'"):
        bounded_int(0, 100, zero_means="no limit")("-1")


def test_bounded_size_reads_units_and_names_its_range():
    size = bounded_size(1 << 20, 1 << 40)
    assert size("1MiB") == 1 << 20 and size("1T") == 1 << 40 and size("64m") == 64 << 20
    for text in ("1023k", "2TiB", "x", "-1M"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"takes a size from 1MiB to 1TiB \(examples: "):
            size(text)


def test_argparse_names_the_flag():
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=bounded(1, 3600, "seconds"))
    parser.error = lambda message: (_ for _ in ()).throw(ValueError(message))  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"argument --window: takes 1 to 3600 seconds \(1 hour\), not '0'"):
        parser.parse_args(["--window", "0"])
