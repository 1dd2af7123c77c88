"""Identity: reading a live tree's mapped and open files, cached hashing, comparison, waivers."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapctl.errors import ExitStatus, SnapctlError
from snapctl.images.identity.compare import (
    IdentityMismatchError,
    compare,
    needless_waivers,
    require_match,
)
from snapctl.images.identity.host import current_identity, hashed_env
from snapctl.images.identity.models import FileRecord
from snapctl.images.identity.tree import FileView, hash_files, tree_files
from tests.images.factories import SALT, make_identity

HOLDER = """
import mmap, os, sys
mapped_path, open_path, deleted_path = sys.argv[1:4]
with open(mapped_path, "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
held = open(open_path, "rb")
gone = open(deleted_path, "rb")
os.unlink(deleted_path)
null = open("/dev/null", "rb")
r, w = os.pipe()
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path, Path, Path]]:
    mapped, held, deleted = tmp_path / "model.bin", tmp_path / "cache.db", tmp_path / "gone"
    for path in (mapped, held, deleted):
        path.write_bytes(os.urandom(4096))
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(mapped), str(held), str(deleted)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    yield proc, mapped, held, deleted
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


def test_tree_files_finds_mapped_and_open_files_only(
    holder: tuple[subprocess.Popen[str], Path, Path, Path],
) -> None:
    proc, mapped, held, deleted = holder

    files = tree_files([proc.pid])

    assert str(mapped) in files and str(held) in files
    assert os.path.realpath(sys.executable) in files  # the interpreter is mapped
    assert str(deleted) not in files and all(" (deleted)" not in p for p in files)
    assert not any(p.startswith(("/dev/", "/proc/", "pipe:", "socket:")) for p in files)
    assert files == sorted(set(files))


def test_tree_files_skips_processes_that_are_gone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)

    assert tree_files([proc.pid]) == []


def test_hash_files_caches_by_stat_and_sees_every_change(tmp_path: Path) -> None:
    path, cache = tmp_path / "lib.so", tmp_path / "cache"
    path.write_bytes(b"a" * 1000)

    first = hash_files([str(path), str(tmp_path / "missing")], cache)
    assert [r.path for r in first] == [str(path)]  # missing files are left out
    assert len(list(cache.iterdir())) == 1
    assert hash_files([str(path)], cache) == first  # cache hit

    path.write_bytes(b"b" * 1000)  # same size: only stat (mtime/ctime) tells
    changed = hash_files([str(path)], cache)
    assert changed[0].sha256 != first[0].sha256

    (next(cache.iterdir())).write_text("{not json")
    assert hash_files([str(path)], cache) == changed  # a damaged entry only costs a re-hash


def test_current_identity_records_env_hashed_without_volatile_or_snapctl_names() -> None:
    env = {"PATH": "/bin", "HF_TOKEN": "hf_secret", "PWD": "/x", "SNAPCTL_STATE_DIR": "/s",
           "PYTEST_CURRENT_TEST": "t", "FIXTURE_API_KEY": "k", "CRIU_FAULT": "4"}  # fmt: skip

    identity = current_identity(criu_version="4.2.1", argv=["a"], env=env, files=[],
                                cache_dir=None)  # fmt: skip

    assert sorted(identity.env) == ["HF_TOKEN", "PATH"]
    assert "hf_secret" not in identity.model_dump_json()
    assert identity.kernel == os.uname().release and identity.host_id
    again = current_identity(criu_version="4.2.1", argv=["a"], env=env, files=[],
                             cache_dir=None, env_salt=identity.env_salt)  # fmt: skip
    assert compare(identity, again) == []


def test_compare_names_every_difference_and_never_a_secret() -> None:
    recorded = make_identity()
    current = make_identity(
        kernel="6.19.1",
        kernel_features=["mnt_ns", "pid_ns"],  # lost net_ns; a new feature is fine
        cpu_flags=["avx", "sse4_2", "avx512f"],  # lost avx2; a new flag is fine
        host_id="cd" * 16,
        argv=["srv", "--api-key", "***", "--port", "9"],
        env=hashed_env({"PATH": "/usr/bin", "HF_TOKEN": "other_secret", "NEW": "1"}, SALT),
        files=[FileRecord(path="/usr/lib/libx.so", size=3, sha256="1" * 64)],
        hostname="elsewhere",
        cpu_model="other",  # not compared
    )

    differences = compare(recorded, current)

    fields = [d.field for d in differences]
    assert fields == ["kernel", "kernel_features", "cpu_flags", "argv", "host_id", "hostname",
                      "env", "env", "files"]  # fmt: skip
    refusing = [d.field for d in differences if d.refuses]
    assert refusing == ["kernel", "kernel_features", "cpu_flags", "argv", "files"]
    assert differences[4].detail == "image abababab..., here cdcdcdcd..."  # never the whole id
    text = " ".join(d.detail for d in differences)
    assert "avx2" in text and "lacks net_ns" in text and "NEW is set here" in text
    assert "HF_TOKEN has another value" in text and "/usr/lib/libx.so has other content" in text
    assert "secret" not in text
    assert [d.waivable for d in differences][-1] is False


def test_another_machine_and_restorer_environment_never_refuse() -> None:
    recorded = make_identity()
    current = make_identity(
        host_id="cd" * 16,
        hostname="host-b",
        env=hashed_env({"PATH": "/usr/bin", "HF_TOKEN": "hf_secret_value", "FOO": "1"}, SALT),
    )

    shown = require_match(recorded, current)

    assert [(d.field, d.refuses) for d in shown] == [
        ("host_id", False), ("hostname", False), ("env", False)]  # fmt: skip
    assert "FOO is set here but was not at capture" in shown[2].detail
    # An older script's waivers are still accepted, and have nothing left to waive.
    assert require_match(recorded, current, allow=["host_id", "env"]) == shown
    assert needless_waivers(["host_id", "kernel", "env"]) == ["env", "host_id"]


def test_images_without_recorded_kernel_features_compare_without_them() -> None:
    recorded = make_identity(kernel_features=None)

    assert compare(recorded, make_identity(kernel_features=[])) == []
    assert compare(make_identity(), make_identity(kernel_features=None)) == []


def test_missing_and_resized_files_are_differences() -> None:
    recorded = make_identity(files=[FileRecord(path="/a", size=1, sha256="0" * 64),
                                    FileRecord(path="/b", size=1, sha256="0" * 64)])  # fmt: skip
    current = make_identity(files=[FileRecord(path="/b", size=2, sha256="0" * 64)])

    details = [d.detail for d in compare(recorded, current)]

    assert details == ["/a is missing", "/b changed size (1 -> 2 bytes)"]


def test_require_match_refuses_and_waives_named_fields_only() -> None:
    recorded = make_identity()
    current = make_identity(kernel="7.0", cpu_flags=["avx"], env={})

    with pytest.raises(IdentityMismatchError) as info:
        require_match(recorded, current)
    assert info.value.exit_status == ExitStatus.VERIFY_FAILED
    assert "kernel: image 6.18.0, here 7.0" in info.value.message
    assert "--allow-mismatch cpu_flags --allow-mismatch kernel" in info.value.message
    assert "env" not in info.value.message  # shown by copy, never a reason to refuse
    with pytest.raises(IdentityMismatchError, match="cpu_flags"):
        require_match(recorded, current, allow=["kernel"])

    shown = require_match(recorded, current, allow=["kernel", "cpu_flags"])
    assert {d.field for d in shown} == {"kernel", "cpu_flags", "env"}


def test_file_mismatches_cannot_be_waived() -> None:
    recorded = make_identity()
    current = make_identity(files=[])

    with pytest.raises(IdentityMismatchError, match=r"libx\.so is missing"):
        require_match(recorded, current, allow=["kernel"])
    with pytest.raises(SnapctlError, match="cannot be waived"):
        require_match(recorded, current, allow=["files"])
    with pytest.raises(SnapctlError, match="unknown identity field 'colour'"):
        require_match(recorded, recorded, allow=["colour"])


def test_schema_1_image_has_no_identity_and_needs_a_waiver() -> None:
    with pytest.raises(IdentityMismatchError, match="records no identity"):
        require_match(None, None)
    assert [d.field for d in require_match(None, None, allow=["identity"])] == ["identity"]


def test_a_container_s_files_are_read_inside_its_root_whatever_its_links_say(
    tmp_path: Path,
) -> None:
    import hashlib

    root = tmp_path / "container"
    (root / "lib").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_bytes(b"the container's own\n")
    (root / "lib" / "absolute").symlink_to("/etc/passwd")  # the host's, read from here
    (root / "lib" / "climbing").symlink_to("../../../../../../../../etc/passwd")
    (root / "lib" / "to-the-host-only").symlink_to("/etc/hostname")
    own = hashlib.sha256(b"the container's own\n").hexdigest()
    records = hash_files(["/lib/absolute", "/lib/climbing", "/lib/to-the-host-only"], None,
                         view=FileView(root))  # fmt: skip
    assert [(r.path, r.sha256) for r in records] == [
        ("/lib/absolute", own), ("/lib/climbing", own),
    ]  # fmt: skip
    # On the host the same paths are the host's.
    assert Path("/etc/hostname").exists()


def test_a_volume_of_the_view_is_read_from_its_own_directory(tmp_path: Path) -> None:
    root, volume = tmp_path / "container", tmp_path / "volume"
    (root / "models").mkdir(parents=True)
    (root / "models" / "w.bin").write_bytes(b"the empty mount point's")
    (volume / "m").mkdir(parents=True)
    (volume / "m" / "w.bin").write_bytes(b"the volume's")
    (volume / "m" / "up").symlink_to("../../container/models/w.bin")  # stays in the volume
    (tmp_path / "single").write_bytes(b"a file volume")
    view = FileView(root, {"/models": volume, "/etc/one": tmp_path / "single"})
    records = hash_files(["/models/m/w.bin", "/models/w.bin", "/models/m/up", "/etc/one"],
                         None, view=view)  # fmt: skip
    digest = {r.path: r.sha256 for r in records}
    assert digest == {
        "/models/m/w.bin": hashlib.sha256(b"the volume's").hexdigest(),
        "/etc/one": hashlib.sha256(b"a file volume").hexdigest(),
    }


def test_a_fifo_or_a_device_at_a_recorded_path_is_left_out_unopened(tmp_path: Path) -> None:
    root = tmp_path / "container"
    (root / "lib").mkdir(parents=True)
    os.mkfifo(root / "lib" / "fifo")  # its open would wait for a writer
    (root / "lib" / "null").symlink_to("/dev/null")  # in the root: none there
    (root / "lib" / "file").write_bytes(b"x")
    found = hash_files(["/lib/fifo", "/lib/null", "/lib/file"], None, view=FileView(root))
    assert [record.path for record in found] == ["/lib/file"]
    os.mkfifo(tmp_path / "host-fifo")
    assert hash_files([str(tmp_path / "host-fifo")], None) == []


def test_host_and_container_reads_of_a_path_keep_cache_entries_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from snapctl.images.identity import tree

    path = tmp_path / "lib.so"
    path.write_bytes(b"x" * 1000)
    cache = tmp_path / "cache"
    view = FileView(Path("/"))  # a container whose files are this host's, as --rootfs /:O
    on_host = hash_files([str(path)], cache)
    in_container = hash_files([str(path)], cache, view=view)
    assert on_host == in_container and len(list(cache.iterdir())) == 2

    def hashed_again(*args: object) -> None:
        raise AssertionError("hashed again: the other's turn evicted its entry")

    monkeypatch.setattr(tree, "_hash_one", hashed_again)
    for _ in range(2):  # copies taking turns: every one a cache hit
        assert hash_files([str(path)], cache) == on_host
        assert hash_files([str(path)], cache, view=view) == in_container
