"""find_criu: option > SNAPCTL_CRIU > prefix > PATH, old versions rejected, explicit errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapctl.criu import CriuBinary, find_criu
from snapctl.criu.locate import CriuNotFound, criu_version


def make_criu(path: Path, version: str = "4.2.1", *, check_rc: int = 0) -> Path:
    """A fake ``criu`` that reports ``version`` and answers ``check`` with ``check_rc``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --version ]; then echo "Version: {version}"; exit 0; fi\n'
        f'if [ "$1" = check ]; then echo "check says {check_rc}"; exit {check_rc}; fi\n'
        "exit 99\n"
    )
    path.chmod(0o755)
    return path


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Empty, isolated candidate places: the real prefix and PATH never leak in."""
    prefix = tmp_path / "prefix"
    bin_dir = tmp_path / "path-bin"
    bin_dir.mkdir()
    monkeypatch.delenv("SNAPCTL_CRIU", raising=False)
    monkeypatch.setenv("SNAPCTL_CRIU_PREFIX", str(prefix))
    monkeypatch.setenv("PATH", str(bin_dir))
    return {
        "option": tmp_path / "option" / "criu",
        "env": tmp_path / "env" / "criu",
        "prefix": prefix / "bin" / "criu",
        "path": bin_dir / "criu",
    }


def test_option_wins_over_everything(
    places: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    for i, path in enumerate(places.values()):
        make_criu(path, f"4.2.{i}")
    monkeypatch.setenv("SNAPCTL_CRIU", str(places["env"]))

    found = find_criu(places["option"])

    assert found == CriuBinary(path=places["option"], version="4.2.0", source="option")


def test_env_wins_over_prefix_and_path(
    places: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("env", "prefix", "path"):
        make_criu(places[name], "4.3.0" if name == "env" else "4.2.1")
    monkeypatch.setenv("SNAPCTL_CRIU", str(places["env"]))

    found = find_criu()

    assert (found.source, found.path, found.version) == ("env", places["env"], "4.3.0")


def test_prefix_wins_over_path(places: dict[str, Path]) -> None:
    make_criu(places["prefix"])
    make_criu(places["path"])

    assert find_criu().source == "prefix"


def test_path_is_the_last_resort(places: dict[str, Path]) -> None:
    make_criu(places["path"], "5.0")

    found = find_criu()

    assert (found.source, found.path, found.version_tuple) == ("path", places["path"], (5, 0))


def test_too_old_prefix_falls_through_to_path(places: dict[str, Path]) -> None:
    make_criu(places["prefix"], "4.1.1")
    make_criu(places["path"], "4.2.1")

    assert find_criu().source == "path"


def test_only_old_versions_is_an_error_naming_them(places: dict[str, Path]) -> None:
    make_criu(places["prefix"], "3.17.1")
    make_criu(places["path"], "4.1.1")

    with pytest.raises(CriuNotFound) as caught:
        find_criu()

    message = str(caught.value)
    assert "3.17.1" in message and "4.1.1" in message and "install-criu" in message


def test_nothing_found_points_at_the_installer(places: dict[str, Path]) -> None:
    with pytest.raises(CriuNotFound, match=r"no CRIU >= 4\.2 found.*install-criu"):
        find_criu()


def test_explicit_too_old_is_an_error_not_a_fallback(places: dict[str, Path]) -> None:
    make_criu(places["option"], "4.1.1")
    make_criu(places["path"], "4.2.1")

    with pytest.raises(CriuNotFound, match=r"4\.1\.1 .* too old") as caught:
        find_criu(places["option"])

    assert caught.value.path == places["option"]


def test_missing_explicit_path_is_an_error(places: dict[str, Path]) -> None:
    make_criu(places["path"])

    with pytest.raises(CriuNotFound, match="given by option does not exist") as caught:
        find_criu(places["option"])

    assert caught.value.path == places["option"]


def test_missing_env_path_is_an_error(
    places: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_criu(places["prefix"])
    monkeypatch.setenv("SNAPCTL_CRIU", str(places["env"]))

    with pytest.raises(CriuNotFound, match="given by env does not exist"):
        find_criu()


def test_unreadable_version_is_an_error(tmp_path: Path) -> None:
    broken = tmp_path / "criu"
    broken.write_text("#!/bin/sh\necho 'no version here' >&2\nexit 1\n")
    broken.chmod(0o755)

    with pytest.raises(CriuNotFound, match="--version failed: no version here"):
        criu_version(broken)


def test_a_version_that_never_comes_is_an_error(tmp_path: Path) -> None:
    stuck = tmp_path / "criu"
    stuck.write_text("#!/bin/sh\nexec sleep 30\n")
    stuck.chmod(0o755)

    with pytest.raises(CriuNotFound, match=r"did not answer within 0\.2 s"):
        criu_version(stuck, timeout_s=0.2)


def test_not_executable_is_an_error(tmp_path: Path) -> None:
    plain = tmp_path / "criu"
    plain.write_text("not a program\n")

    with pytest.raises(CriuNotFound, match="cannot run"):
        criu_version(plain)


@pytest.mark.parametrize(("check_rc", "passed"), [(0, True), (1, False)])
def test_check_reports_the_exit_status_and_output(
    tmp_path: Path, check_rc: int, passed: bool
) -> None:
    criu = CriuBinary(make_criu(tmp_path / "criu", check_rc=check_rc), "4.2.1", "option")

    assert criu.check() == (passed, f"check says {check_rc}")


def unpacked_prefix(prefix: Path, launch: str | None) -> Path:
    """A prefix as scripts/install-criu leaves it: bin/criu wrapper, an executable "loader"
    and "program" (here: shell scripts), and ``launch`` as snapctl-launch.json."""
    wrapper = make_criu(prefix / "bin" / "criu")
    loader = prefix / "usr" / "lib" / "ld.so"
    loader.parent.mkdir(parents=True)
    # Runs "program" the way the real loader would: skip --library-path and its value.
    loader.write_text('#!/bin/sh\nshift 2\nexec "$@"\n')
    loader.chmod(0o755)
    make_criu(prefix / "usr" / "sbin" / "criu", check_rc=3)
    if launch is not None:
        (prefix / "snapctl-launch.json").write_text(launch)
    return wrapper


LAUNCH = (
    '{"loader": "usr/lib/ld.so", "library_path": ["usr/lib", "lib"], "program": "usr/sbin/criu"}'
)


def test_an_unpacked_prefix_runs_through_its_loader_without_the_wrapper(
    places: dict[str, Path],
) -> None:
    prefix = places["prefix"].parent.parent
    unpacked_prefix(prefix, LAUNCH)
    found = find_criu()
    assert found.path == places["prefix"]
    assert found.argv == (
        str(prefix / "usr/lib/ld.so"), "--library-path", f"{prefix}/usr/lib:{prefix}/lib",
        str(prefix / "usr/sbin/criu"),
    )  # fmt: skip
    # check goes through the loader to the program (exit 3), not through the wrapper (exit 0).
    assert found.check() == (False, "check says 3")


@pytest.mark.parametrize(
    "launch",
    [None, "{not json", '{"loader": "usr/lib/ld.so"}', LAUNCH.replace("usr/lib/ld.so", "gone")],
)
def test_a_prefix_without_a_usable_launch_file_runs_its_wrapper(
    places: dict[str, Path], launch: str | None
) -> None:
    unpacked_prefix(places["prefix"].parent.parent, launch)
    found = find_criu()
    assert found.argv == (str(places["prefix"]),)
    assert found.check() == (True, "check says 0")
