"""How a serving run turns what it saw into checks: a step that was expected but did not
happen becomes a failed check, never a missing one."""

from __future__ import annotations

from pathlib import Path

from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import NoNativeStep
from snapctl.criu import CriuBinary
from snapctl.qualification.checks import Check
from snapctl.qualification.runs import LazyPages, RunContext, _Served, _serving_checks
from snapctl.qualification.watch import Residue
from snapctl.statedir import StateDir
from tests.qualification.factories import make_audit, make_observation, make_pages

CRIU = CriuBinary(path=Path("/opt/snapctl/criu/bin/criu"), version="4.2.1", source="prefix")


def _context(tmp_path: Path) -> RunContext:
    return RunContext(
        options=LaunchOptions(), criu=CRIU, native=NoNativeStep(),
        state=StateDir(tmp_path / "state"), image=tmp_path / "image", work=tmp_path,
        progress=lambda _: None, reference=make_observation(),
    )  # fmt: skip


def _by_name(found: list[Check]) -> dict[str, Check]:
    return {check.name: check for check in found}


def test_a_copy_asked_for_lazy_pages_but_restored_without_them_fails(tmp_path: Path) -> None:
    served = _Served(observation=make_observation(), audit=make_audit(), how="terminated")

    found = _by_name(
        _serving_checks(_context(tmp_path), served, before={}, res=Residue(), expect_lazy=True)
    )

    pages = found["pages complete"]
    assert pages.status == "failed" and "not restored lazily" in pages.evidence


def test_a_plain_copy_has_no_page_checks(tmp_path: Path) -> None:
    served = _Served(observation=make_observation(), audit=make_audit(), how="terminated")

    found = _by_name(_serving_checks(_context(tmp_path), served, before={}, res=Residue()))

    assert "pages complete" not in found


def test_a_lazy_copy_whose_pages_completed_passes_the_page_check(tmp_path: Path) -> None:
    served = _Served(
        observation=make_observation(), audit=make_audit(), how="terminated", pages=make_pages()
    )
    lazy = LazyPages(lazy_pages_pid=41, complete_when_ready=False, pages_complete=True)

    found = _by_name(
        _serving_checks(
            _context(tmp_path), served, before={}, res=Residue(), expect_lazy=True, lazy=lazy
        )
    )

    assert found["pages complete"].status == "passed"


def test_an_image_that_could_not_be_hashed_before_the_run_fails(tmp_path: Path) -> None:
    served = _Served(observation=make_observation(), audit=make_audit(), how="terminated")

    found = _by_name(_serving_checks(_context(tmp_path), served, before=None, res=Residue()))

    image = found["image unchanged"]
    assert image.status == "failed" and "before the run" in image.evidence


def test_a_keyless_server_s_key_check_says_how_to_give_it_one(tmp_path: Path) -> None:
    keyless = make_observation().model_copy(
        update={"auth": {"missing": 200, "wrong": 200, "right": 200}}
    )
    served = _Served(observation=keyless, audit=make_audit(), how="terminated")
    ctx = _context(tmp_path)
    ctx.keyless_hint = "name it with --api-key-env VAR"

    found = _by_name(_serving_checks(ctx, served, before={}, res=Residue()))

    auth = found["API key enforced"]
    assert auth.status == "failed" and "started without one" in auth.evidence
    assert auth.evidence.endswith("name it with --api-key-env VAR")


def test_the_key_check_is_skipped_when_qualifying_without_a_key(tmp_path: Path) -> None:
    keyless = make_observation().model_copy(
        update={"auth": {"missing": 200, "wrong": 200, "right": 200}}
    )
    served = _Served(observation=keyless, audit=make_audit(), how="terminated")
    ctx = _context(tmp_path)
    ctx.check_api_key = False

    found = _by_name(_serving_checks(ctx, served, before={}, res=Residue()))

    assert found["API key enforced"].status == "skipped"
    assert "--no-api-key" in found["API key enforced"].evidence
