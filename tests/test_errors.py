"""The exit-code table: every error class declares its code, and docs/errors.md lists it."""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path

import snapctl
from snapctl.cli import exit_status_for
from snapctl.criu import CriuError
from snapctl.errors import ExitStatus, NoSpaceError, SnapctlError, is_no_space

DOC = Path(__file__).resolve().parent.parent / "docs" / "errors.md"


def _all_error_classes() -> Iterator[type[SnapctlError]]:
    for module in pkgutil.walk_packages(snapctl.__path__, "snapctl."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    pending = [SnapctlError]
    while pending:
        cls = pending.pop()
        if not cls.__name__.startswith("_"):
            yield cls
        pending += cls.__subclasses__()


def test_every_error_class_is_in_the_documented_table_with_its_code() -> None:
    rows = dict(re.findall(r"^\| `(\w+)` \| `?([\w ]+?)`? \|", DOC.read_text(), re.MULTILINE))
    for cls in _all_error_classes():
        assert cls.__name__ in rows, f"{cls.__name__} is missing from docs/errors.md"
        documented = rows[cls.__name__]
        if documented not in ("relayed", "by action"):
            assert documented == ExitStatus(cls.exit_status).name, cls.__name__


def test_the_enum_docstring_and_the_doc_list_the_same_codes() -> None:
    doc = DOC.read_text()
    for status in ExitStatus:
        assert f"| {status.value} | `{status.name}` |" in doc
        assert re.search(rf"^\s+{status.value}\s+{status.name}\s", ExitStatus.__doc__ or "", re.M)


def test_criu_errors_map_by_their_own_action() -> None:
    log = Path("/x.log")
    assert exit_status_for(CriuError("dump", 1, log, "")) is ExitStatus.CAPTURE_FAILED
    assert exit_status_for(CriuError("lazy-pages", 1, log, "")) is ExitStatus.ACTIVATION_FAILED
    assert exit_status_for(CriuError("check", 1, log, "")) is ExitStatus.ERROR


def test_no_space_is_found_in_a_chain_and_in_a_criu_log(tmp_path: Path) -> None:
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as error:
            raise SnapctlError("cannot write x") from error
    except SnapctlError as wrapped:
        assert is_no_space(wrapped)
    criu = CriuError("dump", 1, tmp_path / "dump.log", "Error: write: No space left on device")
    assert is_no_space(criu) and not is_no_space(CriuError("dump", 1, tmp_path, "boom"))
    error = NoSpaceError.at(tmp_path / "image", "capture failed")
    assert "ENOSPC" in error.message and str(tmp_path / "image") in error.message
    assert re.search(r"\d+ MiB free", error.message)
    assert error.exit_status is ExitStatus.UNAVAILABLE
