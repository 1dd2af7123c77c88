"""Images are root code: a copy (in-process, through the agent, in its supervisor) refuses an
image that anyone but root (or the user snapctl runs as) could change: the image directory or
a directory or symlink on its path owned by another user or writable by group or others (a
sticky directory above it excepted), or anything in it outside the saved /dev/shm. The
refusal names the path and the command that fixes it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from snapctl.activation.precheck import check_copy_start
from snapctl.activation.requests import CopyRequest
from snapctl.agent.service import AgentService
from snapctl.cli import main
from snapctl.errors import ExitStatus
from snapctl.images.ownership import check_image_owner
from snapctl.images.store import ImageError
from snapctl.pool.supervisor.common import check_request
from snapctl.registry.source import require_image
from snapctl.statedir import StateDir
from tests.images.factories import publish_sample

pytestmark = pytest.mark.timeout(60)
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StateDir:
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SNAPCTL_NO_AGENT", "1")
    return StateDir(tmp_path / "state")


@pytest.fixture
def image(tmp_path: Path) -> Path:
    """A published image under a directory only this user can change (mode 0755)."""
    root = tmp_path / "images"
    root.mkdir(mode=0o755)
    publish_sample(root / "sample")
    return root / "sample"


def refusal(image: Path) -> str:
    with pytest.raises(ImageError) as refused:
        check_image_owner(image)
    assert refused.value.exit_status == ExitStatus.VERIFY_FAILED
    return refused.value.message


def test_an_image_only_its_owner_can_change_is_accepted(image: Path) -> None:
    check_image_owner(image)
    assert require_image(str(image)) == image


def test_an_image_writable_by_others_or_its_group_is_refused_naming_the_fix(image: Path) -> None:
    os.chmod(image, 0o757)
    message = refusal(image)
    assert f"{image} is a directory writable by others (mode 0757)" in message
    assert f"fix: chmod go-w {image}" in message
    os.chmod(image, 0o775)
    assert "writable by its group (mode 0775)" in refusal(image)
    os.chmod(image, 0o1777)  # sticky does not excuse the image itself: anyone could add to it
    assert "writable by its group and others (mode 1777)" in refusal(image)


def test_a_directory_above_writable_by_others_is_refused(image: Path) -> None:
    os.chmod(image.parent, 0o777)
    message = refusal(image)
    assert f"{image.parent} is a directory writable by its group and others (mode 0777)" in message
    assert "only root may be able to change it or any directory above it" in message


def test_a_sticky_directory_above_is_allowed_when_what_is_below_is_trusted(image: Path) -> None:
    os.chmod(image.parent, 0o1777)  # as /tmp: others may add entries, not replace this one
    check_image_owner(image)


@as_root
def test_below_a_sticky_directory_another_user_s_directory_is_refused(image: Path) -> None:
    os.chmod(image.parent.parent, 0o1777)
    os.chown(image.parent, NOBODY, -1)
    message = refusal(image)
    assert f"{image.parent} is a directory owned by uid {NOBODY}, not root" in message
    assert f"fix: chown root {image.parent}" in message


@as_root
def test_an_image_owned_by_another_user_is_refused(image: Path) -> None:
    os.chown(image, NOBODY, -1)
    message = refusal(image)
    assert f"{image} is a directory owned by uid {NOBODY}, not root" in message
    assert f"fix: chown root {image}" in message


@as_root
def test_a_symlink_on_the_path_owned_by_another_user_is_refused(
    image: Path, tmp_path: Path
) -> None:
    link = tmp_path / "link"
    link.symlink_to(image.parent)
    check_image_owner(link / image.name)  # the link's and its target's path are trusted
    os.lchown(link, NOBODY, -1)
    assert f"{link} is a symbolic link owned by uid {NOBODY}" in refusal(link / image.name)


def test_a_symlink_is_followed_and_its_target_s_path_checked(image: Path, tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.rename(image.parent, open_dir / "images")
    os.chmod(open_dir, 0o777)
    link = tmp_path / "link"
    link.symlink_to(open_dir / "images")
    assert f"{open_dir} is a directory writable by its group and others" in refusal(
        link / image.name
    )


def test_inside_the_image_only_the_saved_dev_shm_keeps_other_modes(image: Path) -> None:
    os.chmod(image / "shm", 0o1777)  # what cp -a of /dev/shm leaves
    os.chmod(image / "shm" / "sem.x", 0o666)  # the server's own files, as they were
    check_image_owner(image)
    os.chmod(image / "shm", 0o777)
    assert f"{image / 'shm'} is a directory writable by its group and others" in refusal(image)
    os.chmod(image / "shm", 0o700)
    os.chmod(image / "criu", 0o777)
    assert f"{image / 'criu'} is a directory writable" in refusal(image)
    os.chmod(image / "criu", 0o700)
    os.chmod(image / "criu" / "pages-1.img", 0o646)
    assert f"{image / 'criu' / 'pages-1.img'} is a file writable by others" in refusal(image)


@as_root
def test_inside_the_image_a_file_of_another_user_is_refused_but_not_in_shm(image: Path) -> None:
    os.chown(image / "shm" / "sub" / "f", NOBODY, -1)
    check_image_owner(image)
    os.chown(image / "criu" / "core-1.img", NOBODY, -1)
    assert f"{image / 'criu' / 'core-1.img'} is a file owned by uid {NOBODY}" in refusal(image)


def test_every_copy_path_refuses_before_anything_starts(
    image: Path, state: StateDir, capsys: pytest.CaptureFixture[str]
) -> None:
    os.chmod(image, 0o757)
    with pytest.raises(ImageError, match="writable by others"):
        check_copy_start(image=str(image), allow_mismatch=(), name=None, count=1, publish=None,
                         expose=False, state=state, note=print)  # fmt: skip
    request = CopyRequest(image=str(image))
    service = AgentService(state, pool=None, spawner=None, metrics=None)  # type: ignore[arg-type]
    with pytest.raises(ImageError, match="writable by others"):
        service.check_copy(request, lambda message: None)
    # A copy's supervisor rechecks ports and names, not what its agent checked just before.
    check_request(request, state)
    capsys.readouterr()

    code = main(["copy", "--image", str(image), "--no-lazy"])

    err = capsys.readouterr().err
    assert code == ExitStatus.VERIFY_FAILED and f"fix: chmod go-w {image}" in err
    assert not (state.root / "activations").exists() or not any(
        (state.root / "activations").iterdir()
    )
    # Reading it is not restoring it: inspect still shows it.
    assert main(["inspect", str(image), "--json"]) == 0


@as_root
def test_copy_refuses_an_image_owned_by_another_user(
    image: Path, state: StateDir, capsys: pytest.CaptureFixture[str]
) -> None:
    os.chown(image, NOBODY, -1)
    code = main(["copy", "--image", str(image), "--no-lazy"])
    err = capsys.readouterr().err
    assert code == ExitStatus.VERIFY_FAILED and f"owned by uid {NOBODY}, not root" in err


@as_root
def test_run_as_another_user_its_own_images_are_trusted_too(
    image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user = 4242
    monkeypatch.setattr("snapctl.images.ownership.os.geteuid", lambda: user)
    for path in (image.parent, image, *image.rglob("*")):
        os.lchown(path, user, -1)
    check_image_owner(image)  # root's directories above, the user's own image
    os.chown(image, NOBODY, -1)
    assert f"owned by uid {NOBODY}, not root or uid {user}" in refusal(image)
