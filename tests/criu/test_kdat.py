"""CRIU's kernel probe cache where /run is not a tmpfs: made once per boot and CRIU binary,
handed to CRIU in a private /run, never left in the host's /run. Real unshare and mount (root),
a fake CRIU that saves and reads a cache the way CRIU does."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from snapctl.criu import CriuBinary
from snapctl.criu import kdat as kdat_module
from snapctl.criu.kdat import KdatRecord, cached_kdat, with_private_run
from tests.criu.fakes import install_fake_criu

# check: "probes" and saves /run/criu.kdat (as CRIU does when /run is a tmpfs), counting probes;
# anything else prints what it finds at /run/criu.kdat.
FAKE_CRIU = """#!/bin/bash
if [ "$1" = check ]; then
    echo probe >> "$FAKE_DIR/probes"
    printf 'KDAT-%s' "$(cat /proc/sys/kernel/random/boot_id)" > /run/criu.kdat
    exit 0
fi
cat /run/criu.kdat 2>/dev/null || echo "no cache"
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs in a mount namespace")


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CriuBinary:
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    monkeypatch.setattr(kdat_module, "run_is_tmpfs", lambda: False)
    return install_fake_criu(tmp_path, FAKE_CRIU)


def probes(tmp_path: Path) -> int:
    path = tmp_path / "probes"
    return len(path.read_text().splitlines()) if path.exists() else 0


def host_run_kdat() -> bytes | None:
    try:
        return Path("/run/criu.kdat").read_bytes()
    except FileNotFoundError:
        return None


def test_criu_runs_with_the_cache_in_a_private_run_and_the_host_run_is_untouched(
    fake: CriuBinary, tmp_path: Path
) -> None:
    before = host_run_kdat()
    wrapped = with_private_run(fake, tmp_path / "cache")
    assert wrapped.argv[: len(wrapped.argv) - len(fake.argv)][0].endswith("unshare")
    assert wrapped.argv[-len(fake.argv) :] == fake.argv
    out = subprocess.run([*wrapped.argv, "restore"], capture_output=True, text=True, check=True)
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert out.stdout == f"KDAT-{boot_id}"
    assert host_run_kdat() == before
    assert probes(tmp_path) == 1


def test_the_cache_is_made_once_and_again_when_its_key_changes(
    fake: CriuBinary, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    first = cached_kdat(fake, cache)
    assert first is not None and cached_kdat(fake, cache) == first
    assert probes(tmp_path) == 1
    record = KdatRecord.model_validate_json((cache / "criu.kdat.json").read_bytes())
    # Another boot (or kernel, or CRIU): the record no longer matches, so it is made anew.
    stale = record.model_copy(update={"key": record.key.model_copy(update={"boot_id": "x"})})
    (cache / "criu.kdat.json").write_text(stale.model_dump_json())
    assert cached_kdat(fake, cache) == first
    assert probes(tmp_path) == 2
    # A cache whose bytes changed is not trusted either.
    first.write_bytes(b"tampered")
    cached_kdat(fake, cache)
    assert probes(tmp_path) == 3 and first.read_bytes().startswith(b"KDAT-")


def test_a_criu_that_saves_no_cache_runs_unwrapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kdat_module, "run_is_tmpfs", lambda: False)
    criu = install_fake_criu(tmp_path, "#!/bin/sh\nexit 0\n")
    assert with_private_run(criu, tmp_path / "cache") == criu
    assert not (tmp_path / "cache" / "criu.kdat").exists()


def test_with_a_tmpfs_run_criu_keeps_its_own_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kdat_module, "run_is_tmpfs", lambda: True)
    criu = install_fake_criu(tmp_path, FAKE_CRIU)
    assert with_private_run(criu, tmp_path / "cache") == criu
    assert not (tmp_path / "cache").exists()
