"""Signing against a real registry on loopback and verifying through the trust policy: the
CLI's ``image keygen``, ``image sign`` and ``image verify``, and ``verify_pull`` as the pull
path calls it, with cosign's storage layout checked in the registry."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from snapctl.cli import main
from snapctl.errors import ExitStatus
from snapctl.registry.client import Reference, RegistryClient
from snapctl.registry.push import push_image
from snapctl.trust import keys, payload
from snapctl.trust.errors import PolicyRefusedError
from snapctl.trust.policy import load_policy, verify_pull
from snapctl.trust.store import OCI_CONFIG, OCI_MANIFEST, read_signatures, resolve
from tests.images.factories import publish_sample
from tests.registry.server import RegistryServer

pytestmark = [pytest.mark.registry, pytest.mark.timeout(120)]
PASSWORD = "test passphrase"


@pytest.fixture(autouse=True)
def environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SNAPCTL_KEY_PASSWORD", PASSWORD)


@dataclass(frozen=True)
class Outcome:
    stdout: str
    output: str  # stdout and stderr together, as a person sees them


def invoke(*args: str, status: int = 0, stdin: str | None = None) -> Outcome:
    """The CLI's own entry point (errors become exit codes), with ``stdin`` typed in."""
    with CliRunner().isolation(input=stdin) as (stdout, _, output):
        code = main(list(args))
        outcome = Outcome(stdout.getvalue().decode(), output.getvalue().decode())
    assert code == status, outcome.output
    return outcome


def pushed(server: RegistryServer, tmp_path: Path) -> str:
    """A sample image pushed to a repository of its own; its reference (a tag)."""
    reference = Reference.parse(f"{server.address}/trust/{uuid.uuid4().hex[:12]}:v1")
    image = tmp_path / f"image-{uuid.uuid4().hex[:8]}"
    publish_sample(image)
    client = RegistryClient(reference, plain_http=True)
    try:
        push_image(image, reference, client)
    finally:
        client.close()
    return str(reference)


def key_pair(tmp_path: Path, name: str) -> tuple[Path, Path]:
    record = json.loads(invoke("image", "keygen", str(tmp_path / name), "--json").stdout)
    return Path(record["private_key"]), Path(record["public_key"])


def write_policy(tmp_path: Path, default: list[dict[str, Any]],
                 **scopes: list[dict[str, Any]]) -> Path:  # fmt: skip
    path = tmp_path / f"policy-{uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps({"default": default, "transports": {"docker": scopes}}))
    return path


def requires(public: Path) -> list[dict[str, Any]]:
    return [{"type": "sigstoreSigned", "keyPath": str(public)}]


def verify(reference: str, policy: Path, status: int = 0) -> dict[str, Any]:
    result = invoke("image", "verify", reference, "--policy", str(policy), "--plain-http",
                    "--json", status=status)  # fmt: skip
    if status:
        assert "error:" in result.output
        return {"output": result.output}
    record: dict[str, Any] = json.loads(result.stdout)
    return record


def test_sign_then_the_policy_accepts_the_key_and_refuses_others(
    registry_server: RegistryServer, tmp_path: Path
) -> None:
    reference = pushed(registry_server, tmp_path)
    private, public = key_pair(tmp_path, "release")
    _, other_public = key_pair(tmp_path, "other")
    signed = json.loads(invoke("image", "sign", reference, "--key", str(private),
                               "--plain-http", "--json").stdout)  # fmt: skip
    assert signed["added"] and signed["signatures"] == 1
    assert signed["signed_identity"] == reference
    assert signed["signature_tag"] == f"sha256-{signed['manifest_digest'][7:]}.sig"

    registry = registry_server.address
    accepted = verify(reference, write_policy(tmp_path, [{"type": "reject"}],
                                              **{registry: requires(public)}))  # fmt: skip
    assert accepted["accepted"] and accepted["scope"] == f'transports.docker["{registry}"]'
    assert accepted["manifest_digest"] == signed["manifest_digest"]
    assert f"verified with key {signed['key']}" in accepted["detail"]

    refused = verify(reference, write_policy(tmp_path, requires(other_public)),
                     status=ExitStatus.VERIFY_FAILED)  # fmt: skip
    assert "refused by default (sigstoreSigned" in refused["output"]
    assert "not by its key" in refused["output"]

    by_digest = reference.rsplit(":", 1)[0] + "@" + signed["manifest_digest"]
    assert verify(by_digest, write_policy(tmp_path, requires(public)))["accepted"]
    retagged = reference.rsplit(":", 1)[0] + ":v2"
    invoke("image", "verify", retagged, "--plain-http", status=1)  # no such tag yet


def test_an_unsigned_image_a_reject_scope_and_insecure_accept_anything(
    registry_server: RegistryServer, tmp_path: Path
) -> None:
    reference = pushed(registry_server, tmp_path)
    _, public = key_pair(tmp_path, "release")
    unsigned = verify(reference, write_policy(tmp_path, requires(public)),
                      status=ExitStatus.VERIFY_FAILED)  # fmt: skip
    assert "the image is not signed (no signature manifest sha256-" in unsigned["output"]

    repository = reference.rsplit(":", 1)[0]
    rejected = verify(reference, write_policy(tmp_path, [{"type": "insecureAcceptAnything"}],
                                              **{repository: [{"type": "reject"}]}),
                      status=ExitStatus.VERIFY_FAILED)  # fmt: skip
    assert f'refused by transports.docker["{repository}"] (reject)' in rejected["output"]

    anything = verify(reference, write_policy(tmp_path, [{"type": "insecureAcceptAnything"}]))
    assert anything["accepted"] and anything["requirement"] == "insecureAcceptAnything"


def test_the_signature_is_stored_as_cosign_stores_it_and_appended_once_per_key(
    registry_server: RegistryServer, tmp_path: Path
) -> None:
    reference = pushed(registry_server, tmp_path)
    first, first_public = key_pair(tmp_path, "first")
    second, second_public = key_pair(tmp_path, "second")
    invoke("image", "sign", reference, "--key", str(first), "--plain-http")
    again = invoke("image", "sign", reference, "--key", str(first), "--plain-http")
    assert "already signed by this key" in again.stdout
    both = json.loads(invoke("image", "sign", reference, "--key", str(second),
                             "--plain-http", "--json").stdout)  # fmt: skip
    assert both["added"] and both["signatures"] == 2

    client = RegistryClient(Reference.parse(reference), plain_http=True)
    try:
        digest = resolve(client)
        raw = client.find_manifest(f"sha256-{digest[7:]}.sig", OCI_MANIFEST, 1 << 20)
        assert raw is not None
        manifest = json.loads(raw)
        assert manifest["mediaType"] == OCI_MANIFEST and manifest["schemaVersion"] == 2
        assert manifest["config"]["mediaType"] == OCI_CONFIG
        config = json.loads(
            client.read_blob(
                manifest["config"]["digest"], manifest["config"]["size"], 1 << 20, "config"
            )
        )
        layers = manifest["layers"]
        assert config["rootfs"] == {"type": "layers", "diff_ids": [x["digest"] for x in layers]}
        assert [x["mediaType"] for x in layers] == [payload.MEDIA_TYPE] * 2
        signatures = read_signatures(client, digest)
        assert signatures[0].payload == signatures[1].payload == payload.build(reference, digest)
        for signature, public in zip(signatures, (first_public, second_public), strict=True):
            assert keys.verify(keys.read_public_keys(public)[0], signature.payload,
                               signature.signature)  # fmt: skip
            assert layers[signatures.index(signature)]["annotations"] == {
                "dev.cosignproject.cosign/signature": signature.signature
            }

        # The pull path's call: either key's policy accepts, a third key's refuses.
        parsed = Reference.parse(reference)
        for public in (first_public, second_public):
            policy = load_policy(write_policy(tmp_path, requires(public)))
            assert verify_pull(policy, parsed, digest, client).accepted
        _, third = key_pair(tmp_path, "third")
        with pytest.raises(PolicyRefusedError) as refused:
            verify_pull(load_policy(write_policy(tmp_path, requires(third))), parsed, digest,
                        client)  # fmt: skip
        assert refused.value.verdict.detail.count("is not by its key") == 2
    finally:
        client.close()


def test_keygen_asks_twice_without_the_environment_and_sign_asks_once(
    registry_server: RegistryServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SNAPCTL_KEY_PASSWORD")
    invoke("image", "keygen", str(tmp_path / "typed"), stdin="s3cret\ns3cret\n")
    assert oct((tmp_path / "typed.key").stat().st_mode & 0o777) == "0o600"
    invoke("image", "keygen", str(tmp_path / "typed"), stdin="x\nx\n",
           status=ExitStatus.CONFLICT)  # fmt: skip
    reference = pushed(registry_server, tmp_path)
    wrong = invoke("image", "sign", reference, "--key", str(tmp_path / "typed.key"),
                   "--plain-http", stdin="nope\n", status=ExitStatus.USAGE)  # fmt: skip
    assert "wrong passphrase" in wrong.output
    invoke("image", "sign", reference, "--key", str(tmp_path / "typed.key"), "--plain-http",
           stdin="s3cret\n")  # fmt: skip
    assert os.environ.get("SNAPCTL_KEY_PASSWORD") is None
