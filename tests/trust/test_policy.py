"""The trust policy: containers-policy.json read strictly, the most specific scope chosen, and
the verdict on cosign's and containers/image's signatures (tests/trust/data), with every
refusal naming its rule and reason."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from snapctl.errors import ExitStatus
from snapctl.trust import policy as trust_policy
from snapctl.trust.errors import PolicyFormatError, PolicyRefusedError
from snapctl.trust.identity import Identity, docker_ref, identity_matches, namespaces
from snapctl.trust.policy import evaluate, load_policy, parse_policy
from snapctl.trust.verdict import Verdict
from tests.trust.helpers import (
    COSIGN_REPOSITORY,
    IMAGES,
    SIGNED_DIGEST,
    Fetcher,
    ref,
    stored_signature,
)

pytestmark = pytest.mark.timeout(60)
COSIGN_SIGNED = stored_signature(IMAGES / "dir-img-cosign-valid" / "signature-1")
TAG_SIGNED = stored_signature(IMAGES / "dir-img-cosign-valid-with-tag" / "signature-1")
OTHER_KEY_SIGNED = stored_signature(IMAGES / "unknown-cosign-key.signature")
COSIGN_PUB = str(IMAGES / "cosign.pub")


def policy(default: list[dict[str, Any]] | None = None, **scopes: list[dict[str, Any]]) -> Any:
    document = {"default": default or [{"type": "reject"}],
                "transports": {"docker": scopes}}  # fmt: skip
    return parse_policy(json.dumps(document).encode(), source="policy.json")


def signed_by(key: str = COSIGN_PUB, **identity: str) -> dict[str, Any]:
    requirement: dict[str, Any] = {"type": "sigstoreSigned", "keyPath": key}
    if identity:
        requirement["signedIdentity"] = identity
    return requirement


def refusal(rules: Any, reference: str, fetcher: Fetcher,
            digest: str = SIGNED_DIGEST) -> Verdict:  # fmt: skip
    with pytest.raises(PolicyRefusedError) as raised:
        evaluate(rules, ref(reference), digest, fetcher)
    assert raised.value.exit_status is ExitStatus.VERIFY_FAILED
    verdict = raised.value.verdict
    assert not verdict.accepted and verdict.line() in raised.value.message
    return verdict


def test_cosign_s_signature_is_accepted_with_its_key_and_matchrepository() -> None:
    rules = policy(**{COSIGN_REPOSITORY: [signed_by(type="matchRepository")]})
    verdict = evaluate(rules, ref(f"{COSIGN_REPOSITORY}:latest"), SIGNED_DIGEST,
                       Fetcher(OTHER_KEY_SIGNED, COSIGN_SIGNED))  # fmt: skip
    assert verdict.accepted and verdict.scope == f'transports.docker["{COSIGN_REPOSITORY}"]'
    assert verdict.requirement.startswith("sigstoreSigned, keyPath ")
    assert "signature 2 of 2 verified" in verdict.detail
    assert f"made for {COSIGN_REPOSITORY}" in verdict.detail


def test_the_default_identity_refuses_a_signature_for_a_repository_alone() -> None:
    """cosign signs the repository only; like containers/image, matchRepoDigestOrExact (the
    default) accepts it for no tag and no digest."""
    rules = policy(**{COSIGN_REPOSITORY: [signed_by()]})
    for reference in (f"{COSIGN_REPOSITORY}:latest", f"{COSIGN_REPOSITORY}@{SIGNED_DIGEST}"):
        verdict = refusal(rules, reference, Fetcher(COSIGN_SIGNED))
        assert "matchRepoDigestOrExact does not accept" in verdict.detail


def test_a_signature_for_a_tag_is_accepted_for_that_tag_and_its_digest_only() -> None:
    repository = "192.168.64.2:5000/skopeo-signed"
    rules = policy(**{"192.168.64.2:5000": [signed_by()]})
    accepted = evaluate(rules, ref(f"{repository}:tag"), SIGNED_DIGEST, Fetcher(TAG_SIGNED))
    assert accepted.scope == 'transports.docker["192.168.64.2:5000"]'
    evaluate(rules, ref(f"{repository}@{SIGNED_DIGEST}"), SIGNED_DIGEST, Fetcher(TAG_SIGNED))
    verdict = refusal(rules, f"{repository}:othertag", Fetcher(TAG_SIGNED))
    assert "made for 192.168.64.2:5000/skopeo-signed:tag" in verdict.detail


def test_another_key_a_missing_signature_and_another_digest_are_refused() -> None:
    rules = policy(**{COSIGN_REPOSITORY: [signed_by(type="matchRepository")]})
    name = f"{COSIGN_REPOSITORY}:latest"
    verdict = refusal(rules, name, Fetcher(OTHER_KEY_SIGNED))
    assert verdict.detail == "no signature is accepted: signature 1 is not by its key"
    unsigned = refusal(rules, name, Fetcher())
    assert unsigned.detail.startswith("the image is not signed (no signature manifest sha256-")
    other_digest = "sha256:" + "1" * 64
    moved = refusal(rules, name, Fetcher(COSIGN_SIGNED), digest=other_digest)
    assert f"signs {SIGNED_DIGEST}, not this manifest" in moved.detail
    other = policy(**{COSIGN_REPOSITORY: [signed_by(str(IMAGES / "cosign2.pub"),
                                                    type="matchRepository")]})  # fmt: skip
    assert "not by its key" in refusal(other, name, Fetcher(COSIGN_SIGNED)).detail


def test_keydata_holds_the_key_itself() -> None:
    data = base64.b64encode((IMAGES / "cosign.pub").read_bytes()).decode()
    identity = {"type": "exactRepository", "dockerRepository": COSIGN_REPOSITORY}
    rules = policy(**{"": [{"type": "sigstoreSigned", "keyDatas": [data],
                            "signedIdentity": identity}]})  # fmt: skip
    verdict = evaluate(rules, ref("other.example/x:1"), SIGNED_DIGEST, Fetcher(COSIGN_SIGNED))
    assert verdict.scope == 'transports.docker[""]' and verdict.accepted


def test_reject_and_insecure_accept_anything_need_no_signature() -> None:
    fetcher = Fetcher(COSIGN_SIGNED)
    rules = policy([{"type": "insecureAcceptAnything"}],
                   **{"registry.example:5000/locked": [{"type": "reject"}]})  # fmt: skip
    verdict = evaluate(rules, ref("registry.example:5000/open/x:1"), SIGNED_DIGEST, fetcher)
    assert (verdict.scope, verdict.requirement) == ("default", "insecureAcceptAnything")
    refused = refusal(rules, "registry.example:5000/locked/x:1", fetcher)
    assert refused.scope == 'transports.docker["registry.example:5000/locked"]'
    assert (refused.requirement, refused.detail) == ("reject", "this scope rejects every image")
    assert fetcher.calls == []


def test_every_requirement_of_the_rule_must_accept_and_signatures_are_read_once() -> None:
    fetcher = Fetcher(COSIGN_SIGNED)
    exact = signed_by(type="exactRepository", dockerRepository=COSIGN_REPOSITORY)
    rules = policy(**{COSIGN_REPOSITORY: [{"type": "insecureAcceptAnything"},
                                          signed_by(type="matchRepository"), exact]})  # fmt: skip
    verdict = evaluate(rules, ref(f"{COSIGN_REPOSITORY}:v1"), SIGNED_DIGEST, fetcher)
    assert verdict.requirement.count(" + ") == 2 and fetcher.calls == [SIGNED_DIGEST]
    rules = policy(**{COSIGN_REPOSITORY: [signed_by(type="matchRepository"), {"type": "reject"}]})
    assert refusal(rules, f"{COSIGN_REPOSITORY}:v1", Fetcher(COSIGN_SIGNED)).requirement == (
        "reject")  # fmt: skip


def test_the_most_specific_scope_wins() -> None:
    scopes = ["", "*.com", "*.example.com", "reg.example.com:5000", "reg.example.com:5000/ns",
              "reg.example.com:5000/ns/repo", "reg.example.com:5000/ns/repo:v1",
              f"reg.example.com:5000/ns/repo@{SIGNED_DIGEST}"]  # fmt: skip
    name = "reg.example.com:5000/ns/repo"
    expected = {f"{name}:v1": scopes[6], f"{name}:v2": scopes[5],
                f"{name}:v2@{SIGNED_DIGEST}": scopes[7],
                "reg.example.com:5000/ns/other:1": scopes[4],
                "reg.example.com:5000/x:1": scopes[3], "reg.example.com/x:1": scopes[2],
                "a.b.com/x:1": scopes[1], "a.org/x:1": scopes[0]}  # fmt: skip
    while scopes:
        rules = policy(**{scope: [{"type": "reject"}] for scope in scopes})
        for reference, scope in list(expected.items()):
            if scope in scopes:
                assert rules.rule_for(ref(reference))[0] == f'transports.docker["{scope}"]'
        scopes.pop()
    assert policy().rule_for(ref("a.org/x:1"))[0] == "default"
    assert namespaces("r.example.com:5000/a/b") == [
        "r.example.com:5000/a/b", "r.example.com:5000/a", "r.example.com:5000",
        "*.example.com", "*.com"]  # fmt: skip


def test_identity_rules_follow_containers_image() -> None:
    tagged, digested = docker_ref("r.io/a/b:v1"), docker_ref(f"r.io/a/b@{SIGNED_DIGEST}")
    assert tagged is not None and digested is not None
    cases = [
        (Identity("matchExact"), tagged, "r.io/a/b:v1", True),
        (Identity("matchExact"), tagged, "r.io/a/b", False),
        (Identity("matchExact"), digested, f"r.io/a/b@{SIGNED_DIGEST}", True),
        (Identity("matchRepoDigestOrExact"), digested, "r.io/a/b:v9", True),
        (Identity("matchRepoDigestOrExact"), tagged, "r.io/a/b:v9", False),
        (Identity("matchRepository"), tagged, "r.io/a/b:v9", True),
        (Identity("matchRepository"), tagged, "r.io/a/c", False),
        (Identity("exactReference", (("dockerReference", "r.io/z:1"),)), tagged, "r.io/z:1",
         True),
        (Identity("exactReference", (("dockerReference", "r.io/z:1"),)), tagged, "r.io/z",
         False),
        (Identity("remapIdentity", (("prefix", "r.io/a"), ("signedPrefix", "q.io/m"))),
         tagged, "q.io/m/b:v1", True),
        (Identity("remapIdentity", (("prefix", "r.io/a"), ("signedPrefix", "q.io/m"))),
         tagged, "r.io/a/b:v1", False),
        (Identity("matchRepository"), docker_ref("docker.io/library/busybox:1"), "busybox",
         True),
        (Identity("matchRepository"), tagged, "NOT A REFERENCE", False),
    ]  # fmt: skip
    for identity, intended, signed, expected in cases:
        assert intended is not None
        assert identity_matches(identity, intended, signed) is expected, (identity, signed)


def test_requirements_snapctl_cannot_check_refuse_when_they_apply() -> None:
    scopes: dict[str, list[dict[str, Any]]] = {
        "gpg.example": [{"type": "signedBy", "keyType": "GPGKeys", "keyPath": "/k.gpg"}],
        "fulcio.example": [{"type": "sigstoreSigned", "fulcio": {"caPath": "/ca"}}],
        "rekor.example": [{**signed_by(), "rekorPublicKeyPath": "/rekor.pub"}],
        "ok.example": [{"type": "insecureAcceptAnything"}],
    }
    rules = policy(**scopes)
    assert evaluate(rules, ref("ok.example/x:1"), SIGNED_DIGEST, Fetcher()).accepted
    for host, reason in (("gpg", "GPG signatures"), ("fulcio", "fulcio certificates"),
                         ("rekor", "Rekor key")):  # fmt: skip
        assert reason in refusal(rules, f"{host}.example/x:1", Fetcher(COSIGN_SIGNED)).detail


def test_a_key_that_cannot_be_read_refuses_naming_it(tmp_path: Path) -> None:
    rules = policy(**{"": [signed_by(str(tmp_path / "gone.pub"))]})
    verdict = refusal(rules, "r.example/x:1", Fetcher(COSIGN_SIGNED))
    assert "its key cannot be used" in verdict.detail and "gone.pub" in verdict.detail


@pytest.mark.parametrize(("document", "complaint"), [
    ({"transports": {}}, "the policy lacks default"),
    ({"default": []}, "default must be a non-empty list"),
    ({"default": [{"type": "accept"}]}, "unknown requirement type 'accept'"),
    ({"default": [{"type": "reject", "keyPath": "/k"}]}, "unknown fields: keyPath"),
    ({"default": [{"type": "reject"}], "extra": 1}, "unknown fields: extra"),
    ({"default": [{"type": "sigstoreSigned"}]}, "exactly one of keyPath"),
    ({"default": [{"type": "sigstoreSigned", "keyPath": "/a", "keyData": "eA=="}]},
     "exactly one of keyPath"),
    ({"default": [{"type": "sigstoreSigned", "keyData": "!!"}]}, "not base64"),
    ({"default": [{"type": "sigstoreSigned", "keyPath": "/a",
                   "signedIdentity": {"type": "matchEverything"}}]}, "unknown type"),
    ({"default": [{"type": "sigstoreSigned", "keyPath": "/a",
                   "signedIdentity": {"type": "exactReference"}}]}, "lacks dockerReference"),
    ({"default": [{"type": "reject"}], "transports": {"docker": {"r.io": []}}},
     'transports.docker["r.io"] must be a non-empty list'),
])  # fmt: skip
def test_a_policy_outside_the_format_is_refused(document: object, complaint: str) -> None:
    with pytest.raises(PolicyFormatError, match=r"policy\.json") as raised:
        parse_policy(json.dumps(document).encode(), source="policy.json")
    assert complaint in raised.value.message
    assert raised.value.exit_status is ExitStatus.USAGE


def test_duplicate_keys_and_non_json_are_refused() -> None:
    with pytest.raises(PolicyFormatError, match="duplicate key"):
        parse_policy(b'{"default": [{"type": "reject"}], "default": []}')
    with pytest.raises(PolicyFormatError, match="not JSON"):
        parse_policy(b"default: reject")


def test_without_a_policy_file_everything_is_accepted_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trust_policy, "SYSTEM_POLICY", tmp_path / "absent.json")
    fetcher = Fetcher()
    verdict = evaluate(load_policy(None), ref("r.example/x:1"), SIGNED_DIGEST, fetcher)
    assert verdict.accepted and verdict.policy == trust_policy.BUILT_IN and fetcher.calls == []
    assert verdict.note is not None and "every image is accepted" in verdict.note
    system = tmp_path / "policy.json"
    system.write_text(json.dumps({"default": [{"type": "reject"}]}))
    monkeypatch.setattr(trust_policy, "SYSTEM_POLICY", system)
    assert refusal(load_policy(None), "r.example/x:1", fetcher).policy == str(system)
    with pytest.raises(PolicyFormatError, match="cannot read the policy"):
        load_policy(tmp_path / "missing.json")


def test_a_relative_key_path_is_taken_from_the_policy_s_directory(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "cosign.pub").write_bytes((IMAGES / "cosign.pub").read_bytes())
    (tmp_path / "policy.json").write_text(json.dumps({"default": [
        {"type": "sigstoreSigned", "keyPath": "keys/cosign.pub",
         "signedIdentity": {"type": "matchRepository"}}]}))  # fmt: skip
    rules = load_policy(tmp_path / "policy.json")
    assert evaluate(rules, ref(f"{COSIGN_REPOSITORY}:x"), SIGNED_DIGEST,
                    Fetcher(COSIGN_SIGNED)).accepted  # fmt: skip


def test_a_reference_pinned_to_another_digest_is_refused() -> None:
    rules = policy([{"type": "insecureAcceptAnything"}])
    other = "sha256:" + "2" * 64
    verdict = refusal(rules, f"{COSIGN_REPOSITORY}@{other}", Fetcher(COSIGN_SIGNED))
    assert verdict.detail == f"the reference names {other}, not this manifest"
