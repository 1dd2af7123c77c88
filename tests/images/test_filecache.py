"""The one stat-keyed file cache: every part of the key matters, and both of its users re-hash
a file that changed without changing size (new mtime, or a new inode with the old mtime)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from snapctl.images.filecache import FileCache, path_key, stat_key
from snapctl.images.identity.tree import hash_files
from snapctl.images.store import ImageError, is_verified, verify_image
from tests.images.factories import publish_sample

KEY_PARTS = ["st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns"]


def test_stat_key_is_device_inode_size_mtime_and_ctime(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    st = os.stat(path)
    assert stat_key(st) == [getattr(st, part) for part in KEY_PARTS]
    assert path_key(path) == stat_key(st)


@pytest.mark.parametrize("part", range(len(KEY_PARTS)), ids=KEY_PARTS)
def test_an_entry_holds_only_for_the_exact_keys_it_was_remembered_with(
    tmp_path: Path, part: int
) -> None:
    cache = FileCache(tmp_path / "cache")
    key = [11, 22, 33, 44, 55]
    cache.remember("entry", {"/x": key}, "value")
    assert cache.lookup("entry", {"/x": key}) == "value"
    other = list(key)
    other[part] += 1
    assert cache.lookup("entry", {"/x": other}) is None
    assert cache.lookup("entry", {"/x": key, "/y": key}) is None  # another set of files
    assert cache.lookup("other entry", {"/x": key}) is None


def test_a_damaged_or_foreign_entry_is_a_miss_and_an_unwritable_cache_is_ignored(
    tmp_path: Path,
) -> None:
    cache = FileCache(tmp_path / "cache")
    cache.remember("entry", {"/x": [1, 2, 3, 4, 5]}, "value")
    path = cache.entry_path("entry")
    path.write_text("{not json")
    assert cache.lookup("entry", {"/x": [1, 2, 3, 4, 5]}) is None
    # An entry under this name's file that names another entry (a digest collision).
    path.write_text(json.dumps({"name": "else", "files": {"/x": [1, 2, 3, 4, 5]}, "value": "v"}))
    assert cache.lookup("entry", {"/x": [1, 2, 3, 4, 5]}) is None

    (tmp_path / "blocked").write_text("not a directory")
    FileCache(tmp_path / "blocked").remember("entry", {}, "value")  # no error, nothing written
    assert (tmp_path / "blocked").read_text() == "not a directory"


def _same_size_new_mtime(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    before = os.stat(path)
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))


def _same_size_new_inode_old_mtime(path: Path) -> None:
    """Another file renamed over the first, with its size and mtime: only the inode (and the
    ctime, which cannot be set back) tells."""
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    before = os.stat(path)
    replacement = path.with_name(path.name + ".new")
    replacement.write_bytes(bytes(data))
    os.utime(replacement, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(replacement, path)
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert after.st_ino != before.st_ino


Change = Callable[[Path], None]
CHANGES: dict[str, Change] = {
    "new mtime": _same_size_new_mtime,
    "new inode": _same_size_new_inode_old_mtime,
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_identity_hashing_rehashes_a_changed_file(tmp_path: Path, change: Change) -> None:
    path, cache = tmp_path / "lib.so", tmp_path / "cache"
    path.write_bytes(b"a" * 1000)
    first = hash_files([str(path)], cache)
    assert hash_files([str(path)], cache) == first  # cache hit
    change(path)
    again = hash_files([str(path)], cache)
    assert again[0].size == first[0].size and again[0].sha256 != first[0].sha256


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_image_verification_rehashes_a_changed_file(tmp_path: Path, change: Change) -> None:
    final, cache = tmp_path / "img", tmp_path / "cache"
    manifest = publish_sample(final)
    verify_image(final, cache_dir=cache)
    assert is_verified(final, manifest, cache)
    change(final / "criu" / "pages-1.img")
    assert not is_verified(final, manifest, cache)
    with pytest.raises(ImageError, match=r"pages-1\.img does not match"):
        verify_image(final, cache_dir=cache)


def test_image_verification_and_file_hashes_share_one_entry_format(tmp_path: Path) -> None:
    final, cache = tmp_path / "img", tmp_path / "verified"
    publish_sample(final)
    verify_image(final, cache_dir=cache)
    hash_files([str(final / "manifest.json")], cache / "files")
    image_entries = [p for p in cache.iterdir() if p.is_file()]
    file_entries = list((cache / "files").iterdir())
    assert len(image_entries) == len(file_entries) == 1
    for entry in (image_entries[0], file_entries[0]):
        assert sorted(json.loads(entry.read_text())) == ["files", "name", "value"]
