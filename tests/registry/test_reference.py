"""References, the directory-or-reference rule of ``--image``, credentials' sources and the
OCI layout's own checks (no registry needed)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from snapctl.cli import main
from snapctl.errors import ExitStatus
from snapctl.registry import layout
from snapctl.registry.client import Reference, RegistryClient, RegistryError, docker_configs
from snapctl.registry.source import is_reference

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "registry", "repository", "tag", "digest"),
    [
        ("127.0.0.1:5000/snap/fixture:v1", "127.0.0.1:5000", "snap/fixture", "v1", None),
        ("localhost:5000/a/b/c", "localhost:5000", "a/b/c", "latest", None),
        (f"198.18.20.1:5000/x@{DIGEST}", "198.18.20.1:5000", "x", None, DIGEST),
        (f"h.internal/x:t@{DIGEST}", "h.internal", "x", "t", DIGEST),
    ],
)
def test_references_parse(text: str, registry: str, repository: str, tag: str | None,
                          digest: str | None) -> None:  # fmt: skip
    reference = Reference.parse(text)

    assert (reference.registry, reference.repository, reference.tag, reference.digest) == (
        registry, repository, tag, digest)  # fmt: skip
    assert reference.target == (digest or tag)


@pytest.mark.parametrize("text", ["fixture", "h:1/x@sha256:short", "h:1/x@md5:" + "0" * 32])
def test_bad_references_are_refused(text: str) -> None:
    with pytest.raises(RegistryError):
        Reference.parse(text)


def test_an_existing_directory_is_never_a_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "localhost:5000" / "img").mkdir(parents=True)

    assert not is_reference("localhost:5000/img")
    assert is_reference("localhost:5000/other:v1") and is_reference("reg.internal/a/b")
    assert not is_reference("images/llama") and not is_reference("/srv/image")


def test_credentials_come_from_docker_config_and_refuse_half_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text('{"auths": {}}')
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    assert docker_configs() == [str(tmp_path / "config.json")]

    monkeypatch.setenv("SNAPCTL_REGISTRY_USERNAME", "ci")
    with pytest.raises(RegistryError, match="set both SNAPCTL_REGISTRY_USERNAME"):
        RegistryClient(Reference.parse("127.0.0.1:1/x:y"), plain_http=True)


def test_the_config_refuses_files_outside_the_image_and_chunks_that_do_not_add_up() -> None:
    with pytest.raises(ValueError, match="not a plain path"):
        layout.StoredFile(name="../etc/passwd", size=1, sha256="0" * 64, mode=0o644, uid=0,
                          gid=0, offset=0)  # fmt: skip
    with pytest.raises(ValueError, match="do not add up"):
        layout.StoredFile(name="criu/pages-1.img", size=10, sha256="0" * 64, mode=0o644, uid=0,
                          gid=0, chunks=[layout.Chunk(digest=DIGEST, size=9)])  # fmt: skip
    with pytest.raises(ValueError, match="exactly one of"):
        layout.StoredFile(name="a", size=1, sha256="0" * 64, mode=0o644, uid=0, gid=0)


@pytest.mark.parametrize(
    "location",
    [
        "http://elsewhere.invalid:5000/v2/x/blobs/uploads/1",  # another host
        "https://127.0.0.1:5000/v2/x/blobs/uploads/1",  # another scheme
        "http://127.0.0.1:5001/v2/x/blobs/uploads/1",  # another port
    ],
)
def test_credentials_never_follow_a_location_to_another_origin(location: str) -> None:
    client = RegistryClient(Reference.parse("127.0.0.1:5000/x:y"), plain_http=True)
    client.check_same_origin("http://127.0.0.1:5000/v2/x/blobs/uploads/1?state=a", "Location")
    with pytest.raises(RegistryError, match="only to the registry"):
        client.check_same_origin(location, "the upload Location")


def test_an_unreachable_registry_exits_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("NO_PROXY", "*")  # loopback only, whatever proxy the machine has
    with socket.socket() as never_listens:  # bound, not listening: connections are refused
        never_listens.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{never_listens.getsockname()[1]}"
        code = main(["image", "pull", f"{address}/x/y:v1", "--to", str(tmp_path / "out"),
                     "--plain-http"])  # fmt: skip

    assert code == ExitStatus.UNAVAILABLE
    assert f"cannot reach {address}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
