"""What killed snapctl processes leave outside their activations, and gc's sweep of it: only
what no live process owns is removed."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from snapctl.cli import main
from snapctl.images import ImageStaging, hash_tree
from snapctl.statedir import StateDir
from snapctl.supervision.leftovers import claim, sweep_claims, sweep_records
from tests.images.factories import make_manifest, publish_sample


def _stage_and_die(final: str, claims: str, force: bool) -> None:
    staging = ImageStaging(Path(final), force=force, claims=Path(claims))
    (staging.dir / "criu" / "pages-1.img").write_bytes(b"p" * 4096)
    os._exit(0)  # killed mid-capture: no abort, no publish


def _killed_staging(final: Path, claims: Path, *, force: bool = False) -> list[Path]:
    fork = multiprocessing.get_context("fork")
    child = fork.Process(target=_stage_and_die, args=(str(final), str(claims), force))
    child.start()
    child.join(10)
    assert child.exitcode == 0
    return sorted(final.parent.glob(f".{final.name}.staging-*"))


def test_a_killed_owners_staging_directory_is_removed_once(tmp_path: Path) -> None:
    claims = tmp_path / "state" / "claims"
    left = _killed_staging(tmp_path / "images" / "img", claims)
    assert len(left) == 1

    assert sweep_claims(claims) == [str(left[0])]
    assert not left[0].exists() and list(claims.iterdir()) == []
    assert sweep_claims(claims) == []


def test_a_live_owners_staging_directory_is_left_alone(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    staging = ImageStaging(tmp_path / "img", claims=claims)
    assert sweep_claims(claims) == [] and staging.dir.exists()
    staging.abort()
    assert list(claims.iterdir()) == []  # dropped with the directory


def test_a_published_image_drops_its_claim(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    publish_sample(tmp_path / "img")  # then replace it, claimed
    staging = ImageStaging(tmp_path / "img", force=True, claims=claims)
    (staging.dir / "criu" / "x").write_bytes(b"x")
    staging.publish(make_manifest(hash_tree(staging.dir)))
    assert list(claims.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["claims", "img"]


def test_a_claim_never_names_what_is_not_a_leftover(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        claim(tmp_path / "claims", [tmp_path / "img"])
    # A claim edited to name something else is not obeyed either.
    handle = claim(tmp_path / "claims", [tmp_path / ".img.staging-0123abcd"])
    record = json.loads(handle.path.read_text())
    record["paths"] = [str(tmp_path / "precious")]
    record["owner_pid"] = 2**22 + 1  # no such process
    handle.path.write_text(json.dumps(record))
    (tmp_path / "precious").mkdir()
    assert sweep_claims(tmp_path / "claims") == [] and (tmp_path / "precious").exists()


def test_a_records_tmp_is_removed_only_when_no_one_holds_its_name(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    state.ensure()
    torn = state.records / "web.json.tmp"
    torn.write_text('{"name": "we')
    held = state.reserve_name("web")
    assert sweep_records(state.records) == [] and torn.exists()  # its writer is alive
    held.release()
    assert sweep_records(state.records) == [str(torn)]
    assert sorted(state.records.iterdir()) == []


def test_gc_says_what_it_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    state = StateDir(tmp_path / "state")
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(state.root))
    left = _killed_staging(tmp_path / "img", state.claims)
    state.ensure()
    (state.records / "x.json.tmp").write_text("")
    os.utime(state.records / "x.json.tmp", (time.time() - 5, time.time() - 5))

    assert main(["gc", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == {
        "activations": [],
        "removed": [str(left[0]), str(state.records / "x.json.tmp")],
        "starting": [],
    }
    assert main(["gc"]) == 0
    assert capsys.readouterr().out.strip() == "nothing to clean up"
