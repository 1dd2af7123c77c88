"""scripts/install-criu takes its Debian mirror from the machine's apt sources (deb822 and
one-line), never the security archive or another vendor's repository, unless
SNAPCTL_CRIU_MIRROR says otherwise; run as ``install-criu --print-mirror`` on a fake apt dir.
(Hosts below are in the reserved .invalid domain: no real mirror is named or contacted.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "install-criu"

# This machine's layout: a deb822 file with the archive and its security archive, and other
# vendors' entries that apt does not read (their names end neither in .list nor .sources).
DEBIAN_SOURCES = """\
Types: deb
# http://snapshot.invalid/archive/debian/20250520T000000Z
URIs: http://mirror.invalid/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.invalid/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def print_mirror(apt: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "SNAPCTL_CRIU_MIRROR"}
    return subprocess.run(
        [str(SCRIPT), "--print-mirror"],
        env={**environ, "SNAPCTL_APT_ETC": str(apt), **env},
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


def apt_dir(tmp_path: Path, list_text: str | None = None, **parts: str) -> Path:
    """A fake /etc/apt: ``sources.list`` (when given) and ``sources.list.d/NAME`` files."""
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    if list_text is not None:
        (apt / "sources.list").write_text(list_text)
    for name, text in parts.items():
        (apt / "sources.list.d" / name.replace("__", ".")).write_text(text)
    return apt


def test_the_first_debian_archive_of_deb822_sources(tmp_path: Path) -> None:
    apt = apt_dir(
        tmp_path,
        debian__sources=DEBIAN_SOURCES,
        vendor__list__disabled="deb https://vendor.invalid/apt cloud-sdk-bookworm main\n",
        node__sources__disabled="Types: deb\nURIs: https://node.invalid/deb\nSuites: nodistro\n",
    )
    done = print_mirror(apt)
    assert (done.returncode, done.stdout) == (0, "http://mirror.invalid/debian\n"), done.stderr


def test_the_security_archive_and_other_vendors_are_skipped(tmp_path: Path) -> None:
    security_first = "\n".join(reversed(DEBIAN_SOURCES.split("\n\n")))
    apt = apt_dir(
        tmp_path,
        a_vendor__sources="Types: deb\nURIs: https://vendor.invalid/deb\nSuites: nodistro\n",
        b_debian__sources=security_first,
    )
    done = print_mirror(apt)
    assert done.stdout == "http://mirror.invalid/debian\n", done.stderr


def test_one_line_sources_list_comes_first_and_options_are_skipped(tmp_path: Path) -> None:
    apt = apt_dir(
        tmp_path,
        "# a comment\n"
        "deb-src http://src.invalid/debian bookworm main\n"
        "deb http://security.invalid/debian-security bookworm-security main\n"
        "deb [ arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg ] "
        "http://one-line.invalid/debian/ trixie main contrib  # trailing comment\n",
        debian__sources=DEBIAN_SOURCES,
    )
    done = print_mirror(apt)
    assert done.stdout == "http://one-line.invalid/debian\n", done.stderr


def test_disabled_and_source_only_stanzas_are_skipped_and_the_first_uri_taken(
    tmp_path: Path,
) -> None:
    apt = apt_dir(
        tmp_path,
        debian__sources=(
            "Types: deb\nURIs: http://off.invalid/debian\nSuites: sid\nEnabled: no\n\n"
            "Types: deb-src\nURIs: http://src.invalid/debian\nSuites: sid\n\n"
            "types: deb deb-src\nuris: http://first.invalid/debian\n http://second.invalid/debian\n"
            "suites: unstable\ncomponents: main\n"
        ),
    )
    done = print_mirror(apt)
    assert done.stdout == "http://first.invalid/debian\n", done.stderr


@pytest.mark.parametrize(
    "sources",
    [
        "deb http://archive.invalid/ubuntu jammy main\n",  # not a Debian archive
        "deb http://security.invalid/debian-security bookworm-security main\n",
        "",
    ],
)
def test_no_debian_archive_is_a_clear_error(tmp_path: Path, sources: str) -> None:
    done = print_mirror(apt_dir(tmp_path, sources))
    assert done.returncode == 1 and done.stdout == ""
    assert "no Debian archive in this machine's apt sources" in done.stderr
    assert "set SNAPCTL_CRIU_MIRROR" in done.stderr


def test_snapctl_criu_mirror_still_overrides(tmp_path: Path) -> None:
    apt = apt_dir(tmp_path, debian__sources=DEBIAN_SOURCES)
    done = print_mirror(apt, SNAPCTL_CRIU_MIRROR="http://chosen.invalid/debian/")
    assert done.stdout == "http://chosen.invalid/debian\n", done.stderr


def test_the_script_names_no_mirror_host() -> None:
    text = SCRIPT.read_text()
    assert "http://" not in text and "https://" not in text
