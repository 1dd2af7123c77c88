"""The atomic writer (mode, format, create-once, cleanup) and the bounded reader (file kinds,
size, JSON shape) plus strict model reading."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from snapctl.errors import ProtocolError
from snapctl.protocol.atomic import (
    MAX_JSON_BYTES,
    read_json_bounded,
    read_model,
    replace_file,
    write_json_atomic,
)
from snapctl.protocol.models import Activation, Challenge
from tests.protocol.factories import challenge_fields, make_challenge


def leftovers(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".tmp"))


class TestWrite:
    def test_writes_compact_sorted_json_with_mode_0600(self, tmp_path: Path) -> None:
        target = tmp_path / "challenge.json"
        write_json_atomic(target, make_challenge())
        raw = target.read_bytes()
        assert raw == json.dumps(challenge_fields(), separators=(",", ":"), sort_keys=True).encode()
        assert stat.S_IMODE(target.lstat().st_mode) == 0o600
        assert leftovers(tmp_path) == []

    def test_mode_is_0600_whatever_the_umask(self, tmp_path: Path) -> None:
        previous = os.umask(0)
        try:
            write_json_atomic(tmp_path / "a.json", {"b": 1})
        finally:
            os.umask(previous)
        assert stat.S_IMODE((tmp_path / "a.json").lstat().st_mode) == 0o600

    def test_accepts_a_mapping(self, tmp_path: Path) -> None:
        write_json_atomic(tmp_path / "a.json", {"z": [1, 2], "a": None})
        assert (tmp_path / "a.json").read_text() == '{"a":null,"z":[1,2]}'

    def test_refuses_an_existing_target_without_overwrite(self, tmp_path: Path) -> None:
        target = tmp_path / "a.json"
        write_json_atomic(target, {"n": 1})
        with pytest.raises(ProtocolError, match="refusing to overwrite"):
            write_json_atomic(target, {"n": 2})
        assert json.loads(target.read_text()) == {"n": 1}
        assert leftovers(tmp_path) == []

    def test_refuses_a_dangling_symlink_target(self, tmp_path: Path) -> None:
        (tmp_path / "a.json").symlink_to(tmp_path / "elsewhere.json")
        with pytest.raises(ProtocolError, match="refusing to overwrite"):
            write_json_atomic(tmp_path / "a.json", {"n": 1})
        assert not (tmp_path / "elsewhere.json").exists()

    def test_overwrite_replaces(self, tmp_path: Path) -> None:
        target = tmp_path / "status.json"
        write_json_atomic(target, {"n": 1})
        write_json_atomic(target, {"n": 2}, overwrite=True)
        assert json.loads(target.read_text()) == {"n": 2}
        assert leftovers(tmp_path) == []

    def test_overwrite_replaces_a_symlink_without_following_it(self, tmp_path: Path) -> None:
        victim = tmp_path / "victim"
        victim.write_text("keep")
        (tmp_path / "status.json").symlink_to(victim)
        write_json_atomic(tmp_path / "status.json", {"n": 1}, overwrite=True)
        assert victim.read_text() == "keep"
        assert not (tmp_path / "status.json").is_symlink()

    def test_existing_tmp_file_is_an_error_and_left_alone(self, tmp_path: Path) -> None:
        (tmp_path / "a.json.tmp").write_text("someone else's")
        with pytest.raises(ProtocolError, match=r"a\.json\.tmp"):
            write_json_atomic(tmp_path / "a.json", {"n": 1})
        assert not (tmp_path / "a.json").exists()
        assert (tmp_path / "a.json.tmp").read_text() == "someone else's"

    def test_tmp_symlink_is_never_followed(self, tmp_path: Path) -> None:
        victim = tmp_path / "victim"
        (tmp_path / "a.json.tmp").symlink_to(victim)
        with pytest.raises(ProtocolError):
            write_json_atomic(tmp_path / "a.json", {"n": 1})
        assert not victim.exists()

    def test_failure_after_create_removes_the_tmp(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def broken_fsync(fd: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "fsync", broken_fsync)
        with pytest.raises(ProtocolError, match=r"cannot write a\.json"):
            write_json_atomic(tmp_path / "a.json", {"n": 1})
        assert os.listdir(tmp_path) == []

    def test_interrupt_removes_the_tmp_and_propagates(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def interrupted(src: Any, dst: Any) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(os, "replace", interrupted)
        with pytest.raises(KeyboardInterrupt):
            write_json_atomic(tmp_path / "a.json", {"n": 1})
        assert os.listdir(tmp_path) == []

    @pytest.mark.parametrize("value", [float("nan"), float("inf"), object()], ids=repr)
    def test_non_json_values_are_refused(self, tmp_path: Path, value: object) -> None:
        with pytest.raises(ProtocolError, match="cannot encode"):
            write_json_atomic(tmp_path / "a.json", {"v": value})
        assert os.listdir(tmp_path) == []

    def test_oversized_payload_is_refused(self, tmp_path: Path) -> None:
        with pytest.raises(ProtocolError, match="exceed"):
            write_json_atomic(tmp_path / "a.json", {"v": "x" * MAX_JSON_BYTES})
        assert os.listdir(tmp_path) == []


class TestRead:
    def test_missing_file_is_none(self, tmp_path: Path) -> None:
        assert read_json_bounded(tmp_path / "absent.json") is None

    def test_reads_an_object(self, tmp_path: Path) -> None:
        write_json_atomic(tmp_path / "a.json", {"k": [1, "two"]})
        assert read_json_bounded(tmp_path / "a.json") == {"k": [1, "two"]}

    def test_exactly_the_size_limit_is_accepted(self, tmp_path: Path) -> None:
        body = '{"v":"' + "x" * (MAX_JSON_BYTES - 8) + '"}'
        assert len(body) == MAX_JSON_BYTES
        (tmp_path / "a.json").write_text(body)
        assert read_json_bounded(tmp_path / "a.json") is not None

    def test_oversized_file_is_an_error(self, tmp_path: Path) -> None:
        (tmp_path / "a.json").write_text('{"v":"' + "x" * MAX_JSON_BYTES + '"}')
        with pytest.raises(ProtocolError, match="larger than"):
            read_json_bounded(tmp_path / "a.json")

    def test_symlink_is_an_error_even_to_valid_json(self, tmp_path: Path) -> None:
        write_json_atomic(tmp_path / "real.json", {"k": 1})
        (tmp_path / "a.json").symlink_to(tmp_path / "real.json")
        with pytest.raises(ProtocolError, match="symlink"):
            read_json_bounded(tmp_path / "a.json")

    def test_dangling_symlink_is_an_error_not_absence(self, tmp_path: Path) -> None:
        (tmp_path / "a.json").symlink_to(tmp_path / "nowhere.json")
        with pytest.raises(ProtocolError, match="symlink"):
            read_json_bounded(tmp_path / "a.json")

    def test_fifo_is_an_error_without_blocking(self, tmp_path: Path) -> None:
        os.mkfifo(tmp_path / "a.json", 0o600)
        with pytest.raises(ProtocolError, match="fifo"):
            read_json_bounded(tmp_path / "a.json")

    def test_directory_is_an_error(self, tmp_path: Path) -> None:
        (tmp_path / "a.json").mkdir()
        with pytest.raises(ProtocolError, match="directory"):
            read_json_bounded(tmp_path / "a.json")

    def test_parent_that_is_a_file_is_an_error(self, tmp_path: Path) -> None:
        (tmp_path / "file").write_text("")
        with pytest.raises(ProtocolError):
            read_json_bounded(tmp_path / "file" / "a.json")

    @pytest.mark.parametrize(
        "body",
        [
            b"",
            b'{"version":1,"capture_id":',
            b"{'single': 'quotes'}",
            b'{"a":1}{"b":2}',
            b'{"a":NaN}',
            b'{"a":Infinity}',
            b'{"a":1,"a":2}',
            b'{"a":"\xff"}',
        ],
        ids=["empty", "torn", "not-json", "two-objects", "nan", "infinity", "dup-key", "bad-utf8"],
    )
    def test_malformed_json_is_an_error(self, tmp_path: Path, body: bytes) -> None:
        (tmp_path / "a.json").write_bytes(body)
        with pytest.raises(ProtocolError, match=r"a\.json is not valid JSON"):
            read_json_bounded(tmp_path / "a.json")

    @pytest.mark.parametrize("body", [b"[]", b"1", b'"text"', b"null", b"true"])
    def test_non_object_json_is_an_error(self, tmp_path: Path, body: bytes) -> None:
        (tmp_path / "a.json").write_bytes(body)
        with pytest.raises(ProtocolError, match="JSON object"):
            read_json_bounded(tmp_path / "a.json")


class TestReadModel:
    def test_returns_the_model(self, tmp_path: Path) -> None:
        write_json_atomic(tmp_path / "challenge.json", make_challenge())
        assert read_model(tmp_path / "challenge.json", Challenge) == make_challenge()

    def test_missing_is_none(self, tmp_path: Path) -> None:
        assert read_model(tmp_path / "challenge.json", Challenge) is None

    def test_invalid_content_names_file_and_field_but_not_the_value(self, tmp_path: Path) -> None:
        secret = "f" * 31 + "X"
        write_json_atomic(tmp_path / "challenge.json", challenge_fields(nonce=secret))
        with pytest.raises(ProtocolError, match=r"invalid challenge\.json: nonce") as caught:
            read_model(tmp_path / "challenge.json", Challenge)
        assert secret not in str(caught.value)
        assert caught.value.path == tmp_path / "challenge.json"

    def test_extra_key_is_an_error(self, tmp_path: Path) -> None:
        write_json_atomic(tmp_path / "challenge.json", challenge_fields(extra=True))
        with pytest.raises(ProtocolError, match="extra"):
            read_model(tmp_path / "challenge.json", Challenge)

    def test_wrong_type_is_an_error(self, tmp_path: Path) -> None:
        write_json_atomic(tmp_path / "activation.json", {"port": "80"})
        with pytest.raises(ProtocolError, match="port"):
            read_model(tmp_path / "activation.json", Activation)


def test_replace_file_swaps_the_whole_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "cache.json"
    replace_file(target, b"old")
    replace_file(target, b"new", mode=0o600)
    assert target.read_bytes() == b"new" and target.stat().st_mode & 0o777 == 0o600
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x").touch()
    with pytest.raises(OSError):
        replace_file(tmp_path / "dir", b"over a directory")  # the rename fails
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json", "dir"]
