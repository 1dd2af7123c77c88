"""One log tail: counted in lines, capped in characters, CRIU's error lines kept first."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapctl.logtail import log_tail, text_tail


def test_the_last_lines_of_a_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("".join(f"line {i}\n" for i in range(1, 101)))
    assert log_tail(log, 3) == "line 98\nline 99\nline 100"
    assert log_tail(log).splitlines()[0] == "line 61"  # 40 lines by default
    assert log_tail(tmp_path / "missing.log") == ""


def test_the_character_cap_keeps_whole_lines_and_cuts_only_one_too_long(tmp_path: Path) -> None:
    assert text_tail("aaaa\nbbbb\ncccc", 10, max_chars=10) == "bbbb\ncccc"
    assert text_tail("short\n" + "x" * 50, 10, max_chars=8) == "x" * 8
    log = tmp_path / "big.log"
    log.write_bytes(b"\xff" * 10 + b"y" * 100_000 + b"\nthe end\n")  # read from near the end only
    assert log_tail(log, max_chars=100) == "the end"


def test_error_lines_come_first_when_asked_and_within_half_the_cap() -> None:
    text = "\n".join(["start", "Error (cr-dump.c:1): boom", *(f"filler {i}" for i in range(60))])
    assert "boom" not in text_tail(text)
    kept = text_tail(text, keep_errors=10).splitlines()
    assert kept[0] == "Error (cr-dump.c:1): boom" and kept[-1] == "filler 59"
    assert len(kept) == 41
    many = "\n".join([*(f"error {i} " + "e" * 40 for i in range(20)), "last"])
    capped = text_tail(many, 1, max_chars=200, keep_errors=10)
    assert capped.endswith("\nlast") and len(capped) <= 200
    assert sum(1 for line in capped.splitlines() if line.startswith("error")) == 2


def test_nonsense_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        text_tail("x", 0)
