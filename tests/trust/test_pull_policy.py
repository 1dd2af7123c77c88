"""The trust policy on every pull, against a real registry on loopback: ``image pull`` and
``copy --image REF`` check it once the manifest's digest is known and before any blob is
fetched, an image it refuses is never published, a signed image passes with the right key,
and an image pulled before is used for a reference only if the policy accepts it now."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric import ec

from snapctl.cli import main
from snapctl.errors import ExitStatus
from snapctl.registry.cache import blob_cache, pulled_root
from snapctl.registry.client import Reference, RegistryClient
from snapctl.registry.push import push_image
from snapctl.registry.source import pull_for_copy
from snapctl.statedir import StateDir
from snapctl.trust import keys, policy
from snapctl.trust.errors import PolicyRefusedError
from snapctl.trust.policy import load_policy
from snapctl.trust.sign import sign_image
from tests.images.factories import publish_sample
from tests.registry.server import RegistryServer

pytestmark = [pytest.mark.registry, pytest.mark.timeout(120)]


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StateDir:
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SNAPCTL_NO_AGENT", "1")
    return StateDir(tmp_path / "state")


def pushed(server: RegistryServer, tmp_path: Path) -> str:
    """A sample image pushed to a repository of its own; its reference (a tag)."""
    reference = Reference.parse(f"{server.address}/policy/{uuid.uuid4().hex[:12]}:v1")
    image = tmp_path / f"image-{uuid.uuid4().hex[:8]}"
    publish_sample(image)
    client = RegistryClient(reference, plain_http=True)
    try:
        push_image(image, reference, client)
    finally:
        client.close()
    return str(reference)


def signed_by_new_key(reference: str, tmp_path: Path) -> Path:
    """Sign ``reference`` with a new key (snapctl.trust's signing); its public key file."""
    key = ec.generate_private_key(ec.SECP256R1())
    public = tmp_path / f"key-{uuid.uuid4().hex[:8]}.pub"
    public.write_bytes(keys.public_key_pem(key.public_key()))
    client = RegistryClient(Reference.parse(reference), plain_http=True)
    try:
        assert sign_image(client, key).added
    finally:
        client.close()
    return public


def new_public_key(tmp_path: Path) -> Path:
    public = tmp_path / f"other-{uuid.uuid4().hex[:8]}.pub"
    public.write_bytes(keys.public_key_pem(ec.generate_private_key(ec.SECP256R1()).public_key()))
    return public


def write_policy(tmp_path: Path, default: list[dict[str, Any]],
                 **scopes: list[dict[str, Any]]) -> Path:  # fmt: skip
    path = tmp_path / f"policy-{uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps({"default": default, "transports": {"docker": scopes}}))
    return path


def requires(public: Path) -> list[dict[str, Any]]:
    return [{"type": "sigstoreSigned", "keyPath": str(public)}]


ACCEPT = [{"type": "insecureAcceptAnything"}]
REJECT = [{"type": "reject"}]


def invoke(*args: str) -> tuple[int, str, str]:
    """The CLI's own entry point (errors become exit codes): code, stdout, stderr."""
    with CliRunner().isolation() as (stdout, stderr, _):
        code = main(list(args))
        return code, stdout.getvalue().decode(), stderr.getvalue().decode()


def nothing_fetched_or_published(state: StateDir) -> None:
    """No blob of the image in the cache (not even its config), no pulled image."""
    blobs = blob_cache(state).root
    assert [p for p in blobs.rglob("*") if p.is_file()] == []
    pulled = pulled_root(state)
    assert not pulled.exists() or not any(pulled.iterdir()), sorted(pulled.iterdir())


def test_image_pull_refused_by_a_registry_scope_fetches_and_publishes_nothing(
    registry_server: RegistryServer, tmp_path: Path, state: StateDir
) -> None:
    reference = pushed(registry_server, tmp_path)
    registry = registry_server.address
    rejecting = write_policy(tmp_path, ACCEPT, **{registry: REJECT})
    out = tmp_path / "pulled" / "image"

    code, _, err = invoke("image", "pull", reference, "--to", str(out), "--policy",
                          str(rejecting), "--plain-http")  # fmt: skip

    assert code == ExitStatus.VERIFY_FAILED, err
    assert f'refused by transports.docker["{registry}"] (reject) of {rejecting}' in err
    assert not out.exists() and not (tmp_path / "pulled").exists()
    nothing_fetched_or_published(state)


def test_copy_of_a_reference_refused_by_a_registry_scope_pulls_nothing(
    registry_server: RegistryServer, tmp_path: Path, state: StateDir
) -> None:
    reference = pushed(registry_server, tmp_path)
    registry = registry_server.address
    rejecting = write_policy(tmp_path, ACCEPT, **{registry: REJECT})

    code, _, err = invoke("copy", "--image", reference, "--plain-http", "--policy",
                          str(rejecting), "--no-lazy")  # fmt: skip

    assert code == ExitStatus.VERIFY_FAILED, err
    assert f'refused by transports.docker["{registry}"] (reject)' in err
    nothing_fetched_or_published(state)
    assert not (state.root / "activations").exists() or not any(
        (state.root / "activations").iterdir()
    )


def test_a_signed_image_is_pulled_with_its_key_and_refused_with_another(
    registry_server: RegistryServer, tmp_path: Path, state: StateDir
) -> None:
    reference = pushed(registry_server, tmp_path)
    public = signed_by_new_key(reference, tmp_path)
    registry = registry_server.address

    other = write_policy(tmp_path, REJECT, **{registry: requires(new_public_key(tmp_path))})
    code, _, err = invoke("image", "pull", reference, "--to", str(tmp_path / "refused"),
                          "--policy", str(other), "--plain-http")  # fmt: skip
    assert code == ExitStatus.VERIFY_FAILED and "is not by its key" in err, err
    assert not (tmp_path / "refused").exists()
    nothing_fetched_or_published(state)

    right = write_policy(tmp_path, REJECT, **{registry: requires(public)})
    code, out, err = invoke("image", "pull", reference, "--to", str(tmp_path / "accepted"),
                            "--policy", str(right), "--plain-http", "--json")  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    verdict = report["verdict"]
    assert verdict["accepted"] and verdict["scope"] == f'transports.docker["{registry}"]'
    assert verdict["manifest_digest"] == report["manifest_digest"]
    assert verdict["policy"] == str(right) and verdict["note"] is None
    assert (tmp_path / "accepted" / "manifest.json").is_file()

    # The human form names the rule that accepted it.
    code, out, err = invoke("image", "pull", reference, "--to", str(tmp_path / "again"),
                            "--policy", str(right), "--plain-http")  # fmt: skip
    assert code == 0, err
    assert f'policy: accepted by transports.docker["{registry}"] (sigstoreSigned' in out


def test_an_image_pulled_before_is_checked_again_for_each_reference(
    registry_server: RegistryServer, tmp_path: Path, state: StateDir
) -> None:
    reference = pushed(registry_server, tmp_path)
    public = signed_by_new_key(reference, tmp_path)
    registry = registry_server.address
    first = pull_for_copy(reference, state, plain_http=True,
                          policy=load_policy(write_policy(tmp_path, ACCEPT)))  # fmt: skip
    assert not first.already_pulled and Path(first.image).is_dir()

    rejecting = load_policy(write_policy(tmp_path, ACCEPT, **{registry: REJECT}))
    with pytest.raises(PolicyRefusedError, match=r"\(reject\)"):
        pull_for_copy(reference, state, plain_http=True, policy=rejecting)
    by_digest = reference.rsplit(":", 1)[0] + "@" + first.manifest_digest
    with pytest.raises(PolicyRefusedError):
        pull_for_copy(by_digest, state, plain_http=True, policy=rejecting)
    unsigned_only = load_policy(write_policy(tmp_path, requires(new_public_key(tmp_path))))
    with pytest.raises(PolicyRefusedError, match="is not by its key"):
        pull_for_copy(reference, state, plain_http=True, policy=unsigned_only)

    again = pull_for_copy(reference, state, plain_http=True,
                          policy=load_policy(write_policy(tmp_path, requires(public))))  # fmt: skip
    assert again.already_pulled and again.image == first.image
    assert again.verdict is not None and again.verdict["accepted"]


def test_without_policy_the_system_s_applies_and_without_it_a_note_says_all_are_accepted(
    registry_server: RegistryServer, tmp_path: Path, state: StateDir,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    reference = pushed(registry_server, tmp_path)
    system = write_policy(tmp_path, REJECT)
    monkeypatch.setattr(policy, "SYSTEM_POLICY", system)
    code, _, err = invoke("image", "pull", reference, "--to", str(tmp_path / "out"),
                          "--plain-http")  # fmt: skip
    assert code == ExitStatus.VERIFY_FAILED and f"refused by default (reject) of {system}" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(PolicyRefusedError):
        pull_for_copy(reference, state, plain_http=True)  # the system's policy by default

    monkeypatch.setattr(policy, "SYSTEM_POLICY", tmp_path / "absent.json")
    code, out, err = invoke("image", "pull", reference, "--to", str(tmp_path / "out"),
                            "--plain-http", "--json")  # fmt: skip
    assert code == 0, err
    verdict = json.loads(out)["verdict"]  # --json: one record on stdout, the note inside it
    assert verdict["accepted"] and verdict["note"] == policy.NO_POLICY_NOTE
