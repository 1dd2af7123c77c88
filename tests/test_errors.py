"""The error tree: every class declares its code, and both the drawing in snapctl/errors.py and
the table in docs/errors.md list it, under its base; phases are enums, not free strings."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path

import snapctl
import snapctl.errors
from snapctl.cli import exit_status_for
from snapctl.criu import CriuError
from snapctl.errors import (
    INTERRUPTED_MESSAGE,
    CanaryMismatchError,
    ExitStatus,
    NoSpaceError,
    RelayedError,
    SnapctlError,
    is_no_space,
    wire_outcome,
)
from snapctl.phases import HostPhase, Phase

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "errors.md"


def _all_error_classes() -> Iterator[type[SnapctlError]]:
    for module in pkgutil.walk_packages(snapctl.__path__, "snapctl."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    pending = [SnapctlError]
    while pending:
        cls = pending.pop()
        # snapctl's own: tests derive stand-ins of their own.
        if not cls.__name__.startswith("_") and cls.__module__.startswith("snapctl."):
            yield cls
        pending += cls.__subclasses__()


def _documented_base(cls: type[SnapctlError]) -> str:
    """The nearest public error class ``cls`` derives from (private ones are not drawn)."""
    for base in cls.__mro__[1:]:
        if issubclass(base, SnapctlError) and not base.__name__.startswith("_"):
            return base.__name__
    return ""


def _drawn_tree() -> dict[str, tuple[str, str]]:
    """The drawing in snapctl.errors' docstring: class -> (its base in the drawing, its code)."""
    drawn: dict[str, tuple[str, str]] = {}
    parents: list[str] = []
    for line in (snapctl.errors.__doc__ or "").splitlines():
        found = re.match(r"^    ((?:[│ ]   )*)(?:[├└]── )?(\w+)\s+(\d+|relayed|by action)  ", line)
        if found is None:
            continue
        depth = len(found[1]) // 4 + (1 if "──" in line else 0)
        del parents[depth:]
        drawn[found[2]] = (parents[-1] if parents else "", found[3])
        parents.append(found[2])
    return drawn


def test_every_error_class_is_drawn_in_the_tree_under_its_base_with_its_code() -> None:
    drawn = _drawn_tree()
    classes = list(_all_error_classes())
    for cls in classes:
        assert cls.__name__ in drawn, f"{cls.__name__} is missing from snapctl/errors.py's tree"
        base, code = drawn[cls.__name__]
        assert base == _documented_base(cls), f"{cls.__name__} is drawn under {base!r}"
        if code not in ("relayed", "by action"):
            assert int(code) == cls.exit_status, cls.__name__
    assert sorted(drawn) == sorted(cls.__name__ for cls in classes), "a drawn class is gone"


def test_every_error_class_is_in_the_documented_table_with_its_code() -> None:
    pattern = r"^\| `(\w+)` \| `?([\w ]+?)`? \|\s*`?(\w*)`?\s*\|"
    rows = {name: (code, base) for name, code, base in re.findall(pattern, DOC.read_text(), re.M)}
    for cls in _all_error_classes():
        assert cls.__name__ in rows, f"{cls.__name__} is missing from docs/errors.md"
        documented, base = rows[cls.__name__]
        assert base == _documented_base(cls), f"{cls.__name__} is listed under {base!r}"
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


def test_host_phases_are_distinct_from_the_servers_and_documented() -> None:
    assert not {p.value for p in HostPhase} & {p.value for p in Phase}
    doc = DOC.read_text()
    for phase in HostPhase:
        assert f"| `{phase.value}` |" in doc, f"phase {phase.value!r} is missing from the doc"


def _string_phases(path: Path) -> Iterator[tuple[str, str]]:
    """(callee, value) of every call in ``path`` that passes ``phase="..."`` (not to Status,
    whose phase is the wire's own ``recovering``/``validated``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        callee = ast.unparse(node.func)
        for keyword in node.keywords:
            value = keyword.value
            if keyword.arg == "phase" and isinstance(value, ast.Constant) and callee != "Status":
                yield callee, str(value.value)


def test_no_phase_is_a_free_string() -> None:
    """Every error's ``phase=`` names an enum member, never a string."""
    found = [
        f"{path.relative_to(ROOT).as_posix()}: {callee}(phase={value!r})"
        for path in sorted((ROOT / "snapctl").rglob("*.py"))
        for callee, value in _string_phases(path)
    ]
    assert found == [], "use HostPhase or Phase"


def test_no_getattr_on_an_error() -> None:
    for path in sorted((ROOT / "snapctl").rglob("*.py")):
        found = re.search(r"getattr\((e|err|error|exc|exception)\b", path.read_text())
        assert found is None, f"{path.relative_to(ROOT)}: {found and found[0]}"


def test_the_criu_log_tail_is_the_error_s_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "restore.log"
    log.write_text("(0.1) Error (cr-restore.c:1): no luck\n(0.2) last line\n")
    error = CriuError("restore", 1, log)
    assert error.log_tail is not None and "no luck" in error.log_tail
    assert error.log_tail.endswith("(0.2) last line") and not hasattr(error, "tail")
    assert CriuError("restore", 1, log, "").log_tail is None


def test_an_error_crosses_a_process_boundary_as_it_was() -> None:
    from snapctl.agent.api import ErrorBody  # the agent's floor, above the errors'

    for phase in (HostPhase.RESTORE, Phase.RECOVERY_CANARY, None):
        error = CanaryMismatchError("image /i refused", phase=phase, path="/i", log_tail="tail")
        wire = json.loads(json.dumps(error.to_wire()))
        ErrorBody.model_validate(wire)  # the agent's API documents the same fields
        relayed = RelayedError.from_wire(wire)
        assert (relayed.message, relayed.exit_status, relayed.phase, relayed.path,
                relayed.log_tail) == ("image /i refused", ExitStatus.VERIFY_FAILED, phase,
                                      Path("/i"), "tail")  # fmt: skip
        assert type(relayed.phase) is type(phase)


def test_a_malformed_error_wire_is_relayed_without_failing_again() -> None:
    relayed = RelayedError.from_wire({"error": 5, "status": "4", "phase": "nowhere",
                                      "path": [], "log_tail": {}})  # fmt: skip
    assert (relayed.message, relayed.exit_status, relayed.phase, relayed.path,
            relayed.log_tail) == ("failed without saying why", ExitStatus.ERROR, None, None,
                                  None)  # fmt: skip
    assert RelayedError.from_wire({"error": "x", "status": 999}).exit_status == ExitStatus.ERROR


def test_a_supervisor_reports_an_interrupt_and_a_bug_as_such() -> None:
    interrupted = wire_outcome(KeyboardInterrupt())
    assert (interrupted["error"], interrupted["status"]) == (INTERRUPTED_MESSAGE, 130)
    bug = wire_outcome(ZeroDivisionError("boom"))
    assert bug["error"] == "unexpected ZeroDivisionError in the supervisor: boom"
    assert bug["status"] == 1
