"""Each qualification check on fabricated observations: it passes on a faithful one, and one
injected break per check makes it fail with a message naming what differed."""

from __future__ import annotations

import pytest

from snapctl.criu.lazy.transfer import PagesStatus
from snapctl.qualification import checks
from snapctl.qualification.suite import keyless_hint
from snapctl.qualification.watch import Residue
from tests.qualification.factories import (
    DIGESTS,
    FAILURE,
    make_audit,
    make_completion,
    make_digests,
    make_error,
    make_files,
    make_observation,
    make_pages,
    make_retained,
)


def test_faithful_observation_passes_both_output_checks() -> None:
    reference = make_observation()

    prompts = checks.check_outputs("prompts", reference, make_observation())
    concurrency = checks.check_outputs("concurrency", reference, make_observation())

    assert prompts.status == concurrency.status == "passed"
    assert "6 completions, 69 tokens" in prompts.evidence
    assert "13 completions, 336 tokens" in concurrency.evidence


@pytest.mark.parametrize(
    ("label", "changes", "message"),
    [
        ("greedy-64", {"token_ids": [0, 1, 2, 99, *range(4, 64)]},
         "greedy-64: token 3 differs: expected id 3, got 99"),
        ("one-token-2", {"token_ids": None}, "one-token-2: token ids returned by only one side"),
        ("one-token-0", {"text": "y"}, "one-token-0: text differs: expected 'x', got 'y'"),
        ("greedy-64", {"token_ids": list(range(63)), "text": "x" * 63},
         "greedy-64: 63 tokens, expected 64"),
        ("one-token-4", {"logprobs": [-0.502]}, "one-token-4: logprob of token 0 differs by 0.002"),
        ("one-token-4", {"logprobs": [float("nan")]}, "one-token-4: logprob of token 0 differs"),
        ("one-token-1", {"error": "HTTP 500: boom"}, "one-token-1: request failed: HTTP 500"),
    ],
)  # fmt: skip
def test_prompt_differences_fail_naming_request_and_position(
    label: str, changes: dict[str, object], message: str
) -> None:
    broken = make_observation({label: make_completion(label, **changes)})

    check = checks.check_outputs("prompts", make_observation(), broken)

    assert check.status == "failed"
    assert check.evidence.startswith(message), check.evidence


def test_logprob_within_tolerance_passes() -> None:
    close = make_observation({"one-token-0": make_completion("one-token-0", logprobs=[-0.5009])})

    check = checks.check_outputs("prompts", make_observation(), close)

    assert check.status == "passed" and "0.0009" in check.evidence


@pytest.mark.parametrize(
    ("label", "changes", "message"),
    [
        ("concurrent-2", {"text": "x" * 15 + "z"}, "concurrent-2: text differs"),
        ("stream-16", {"error": "stream error: engine lost"}, "stream-16: request failed"),
        ("pair-7", {"token_ids": [*range(31), 5]}, "pair-7: token 31 differs"),
    ],
)
def test_concurrency_differences_fail(label: str, changes: dict[str, object], message: str) -> None:
    broken = make_observation({label: make_completion(label, **changes)})

    check = checks.check_outputs("concurrency", make_observation(), broken)

    assert check.status == "failed" and check.evidence.startswith(message), check.evidence


def test_a_missing_request_and_a_failed_reference_fail() -> None:
    observed = make_observation()
    del observed.completions["pair-3"]
    assert checks.check_outputs("concurrency", make_observation(), observed).evidence == (
        "pair-3: not sent"
    )
    bad_reference = make_observation({"greedy-64": make_completion("greedy-64", error="timeout")})
    check = checks.check_outputs("prompts", bad_reference, make_observation())
    assert check.status == "failed" and "reference request failed: greedy-64" in check.evidence


def test_several_differences_are_counted() -> None:
    broken = make_observation(
        {f"one-token-{i}": make_completion(f"one-token-{i}", text="?") for i in range(3)}
    )

    check = checks.check_outputs("prompts", make_observation(), broken)

    assert check.evidence.endswith("(and 2 more)")


@pytest.mark.parametrize(
    ("auth", "message"),
    [
        ({"missing": 200, "wrong": 401, "right": 200}, "missing key got 200, expected 401"),
        ({"missing": 401, "wrong": 200, "right": 200}, "wrong key got 200, expected 401"),
        ({"missing": 401, "wrong": 401, "right": 401}, "right key got 401, expected 200"),
        ({"missing": 401, "wrong": 401, "right": 0}, "right key got no answer, expected 200"),
    ],
)
def test_auth(auth: dict[str, int], message: str) -> None:
    assert checks.check_auth({"missing": 401, "wrong": 401, "right": 200}).status == "passed"

    check = checks.check_auth(auth)

    assert check.status == "failed" and check.evidence.startswith(message)


def test_auth_failure_of_a_server_started_without_a_key_says_so_and_how_to_give_one() -> None:
    hint = keyless_hint("SNAPCTL_API_KEY", generated=True)

    check = checks.check_auth({"missing": 200, "wrong": 200, "right": 200}, keyless_hint=hint)

    assert check.status == "failed"
    assert check.evidence.startswith("missing key got 200, expected 401")
    assert "the server serves without an API key: it was started without one" in check.evidence
    assert "$SNAPCTL_API_KEY, generated for this qualification" in check.evidence
    assert "--api-key-env VLLM_API_KEY" in check.evidence and "--no-api-key" in check.evidence
    # A server that refuses a missing key is not keyless: no such explanation.
    wrong = checks.check_auth({"missing": 401, "wrong": 200, "right": 200}, keyless_hint=hint)
    assert "started without" not in wrong.evidence


def test_auth_skipped_by_request_says_so() -> None:
    check = checks.auth_skipped()

    assert (check.name, check.status) == ("API key enforced", "skipped")
    assert check.evidence.startswith("skipped by request (--no-api-key)")


def test_digests_stable_across_run_and_reference() -> None:
    reference = [make_digests(), make_digests()]
    assert checks.check_digests_stable([make_digests()], reference).status == "passed"

    changed = make_digests(digests=DIGESTS | {"lm_head.weight": "c" * 64})
    check = checks.check_digests_stable([make_digests(), changed], reference)

    assert check.status == "failed"
    assert check.evidence.startswith("read 3 differs from read 0: tensor lm_head.weight")


def test_digests_missing_tensor_and_failed_read() -> None:
    fewer = make_digests(digests={"embed.weight": "a" * 64})
    check = checks.check_digests_stable([make_digests(), fewer], [])
    assert check.evidence == "read 1 differs from read 0: tensor lm_head.weight missing"
    assert checks.check_digests_stable([], []).evidence == "no digest read was made"
    error = make_digests(status=503, digests=None, error="engine asleep")
    check = checks.check_digests_stable([make_digests(), error], [])
    assert check.status == "failed" and "answered 503: engine asleep" in check.evidence


def test_absent_digest_endpoint_is_skipped_not_passed() -> None:
    absent = [make_digests(status=404, digests=None)] * 2

    stable = checks.check_digests_stable(absent, absent)
    model = checks.check_digests_match_model(absent, DIGESTS)

    assert stable.status == model.status == "skipped"
    assert stable.evidence == model.evidence == "skipped (endpoint absent)"


def test_digests_against_the_model_file() -> None:
    assert checks.check_digests_match_model([make_digests()], DIGESTS).status == "passed"

    check = checks.check_digests_match_model([make_digests()], DIGESTS | {"embed.weight": "f" * 64})

    assert check.status == "failed"
    assert check.evidence.startswith("served vs model file: tensor embed.weight: aaaaaaaaaaaa…")
    unknown = checks.check_digests_match_model([make_digests()], None)
    assert unknown.status == "skipped"


def test_digests_against_the_images_first_load() -> None:
    check = checks.check_digests_match_capture([make_digests()], DIGESTS)
    assert check.status == "passed"
    assert check.evidence == f"{len(DIGESTS)} tensors equal the digests recorded at capture"

    changed = checks.check_digests_match_capture([make_digests()], DIGESTS | {"x": "f" * 64})

    assert changed.status == "failed"
    assert changed.evidence.startswith("served vs recorded at capture: tensor x missing")
    none = checks.check_digests_match_capture([make_digests()], None)
    assert none.status == "skipped" and "recorded no digests" in none.evidence
    failed_read = checks.check_digests_match_capture([make_digests(status=500, digests=None)],
                                                     DIGESTS)  # fmt: skip
    assert failed_read.evidence == "no digest read succeeded"


def test_image_unchanged() -> None:
    before = make_files()
    assert checks.check_image_unchanged(before, make_files()).status == "passed"

    changed = make_files() | {"criu/pages-1.img": make_files()["criu/pages-1.img"].model_copy(
        update={"sha256": "9" * 64})}  # fmt: skip
    assert checks.check_image_unchanged(before, changed).evidence == (
        "criu/pages-1.img: sha256 changed"
    )
    unlinked = make_files() | {
        "shm/sem.x": make_files()["shm/sem.x"].model_copy(update={"link_group": None})
    }
    assert checks.check_image_unchanged(before, unlinked).evidence == (
        "shm/sem.x: size or hard links changed"
    )
    fewer = dict(make_files())
    del fewer["shm/link_remap.1"]
    assert checks.check_image_unchanged(before, fewer).evidence == "shm/link_remap.1 disappeared"
    more = make_files() | {"criu/extra.img": make_files()["criu/pages-1.img"]}
    assert checks.check_image_unchanged(before, more).evidence == "criu/extra.img appeared"
    assert checks.check_image_unchanged(before, None).status == "failed"
    unhashed = checks.check_image_unchanged(None, make_files())
    assert unhashed.status == "failed" and "before the run" in unhashed.evidence


@pytest.mark.parametrize(
    ("audit", "res", "message"),
    [
        (make_audit(processes=[4242]), Residue(), "stop audit: processes: [4242]"),
        (make_audit(shm_files=["sem.snapctl-fixture-sem-1"]), Residue(),
         "stop audit: shm_files: ['sem.snapctl-fixture-sem-1']"),
        (make_audit(listeners=["127.0.0.1:4000"]), Residue(), "listeners: ['127.0.0.1:4000']"),
        (None, Residue(processes=["77 fixture-engine"]), "processes: ['77 fixture-engine']"),
        (None, Residue(mounts=["/state/activations/copy-1/shm"]), "mounts:"),
        (None, Residue(shm_files=["link_remap.3"]), "shm_files: ['link_remap.3']"),
        (None, Residue(activation_dirs=["/state/activations/copy-1"]), "activation_dirs:"),
    ],
)  # fmt: skip
def test_cleanup(audit: object, res: Residue, message: str) -> None:
    clean = checks.check_cleanup(make_audit(), Residue(), "terminated")
    assert clean.status == "passed" and clean.evidence.startswith("terminated; stop audit")

    check = checks.check_cleanup(audit, res)  # type: ignore[arg-type]

    assert check.status == "failed" and message in check.evidence


def test_cleanup_without_a_stop_audit_claims_only_what_the_host_scan_looked_at() -> None:
    scanned = checks.check_cleanup(None, Residue())

    assert scanned.status == "passed" and scanned.evidence.startswith("host scan: no process")
    assert "listener" not in scanned.evidence
    assert "listener" in checks.check_cleanup(make_audit(), Residue()).evidence


def test_link_remaps_while_serving() -> None:
    assert checks.check_link_remaps([]).status == "passed"
    check = checks.check_link_remaps(["link_remap.1", "link_remap.2"])
    assert check.status == "failed" and check.evidence == (
        "2 left in the activation's /dev/shm: link_remap.1"
    )


def test_error_phase() -> None:
    recovery = checks.check_error_phase(make_error(), expect_phase="recover")
    assert recovery.status == "passed" and recovery.evidence.startswith("recovery: restore memory")

    missing = checks.check_error_phase(None, expect_phase="recover")
    assert missing.status == "failed" and missing.evidence == "no error.json was written"
    timed_out = checks.check_error_phase(
        None, expect_phase="recover", capturer_saw="status.json did not appear within 300 s"
    )
    assert timed_out.evidence == (
        "no error.json was written (the capturer saw: status.json did not appear within 300 s)"
    )
    wrong = checks.check_error_phase(make_error(phase="serve"), expect_phase="capture barrier")
    assert wrong.status == "failed" and wrong.evidence.startswith(
        "phase 'serve', expected 'capture barrier'"
    )
    reason = checks.check_error_phase(
        make_error(phase="capture barrier", error="timed out waiting for release.json"),
        expect_phase="capture barrier", expect_reason=checks.STALE_CONTROL,
    )  # fmt: skip
    assert reason.status == "failed"
    assert reason.evidence.startswith("reason does not mention 'stale activation control'")


@pytest.mark.parametrize(
    ("reason", "message", "said"),
    [
        # snapctl's launcher (the fixture) and vLLM's own words, then ones that must fail.
        (checks.STALE_CONTROL, "stale activation control: release.json, status.json already "
         "present", True),
        (checks.STALE_CONTROL, "stale snapshot activation control: release.json", True),
        (checks.STALE_CONTROL, "Stale snapshot activation control: status.json", True),
        (checks.STALE_CONTROL, "timed out waiting for release.json", False),
        (checks.STALE_CONTROL, "stale snapshot activation control", False),  # names no file
        (checks.STALE_CONTROL, "release.json does not match challenge.json", False),
        (checks.RELEASE_MISMATCH, "release.json does not match challenge.json", True),
        (checks.RELEASE_MISMATCH, "snapshot release does not match this activation challenge",
         True),
        (checks.RELEASE_MISMATCH, "stale snapshot activation control: release.json", False),
        (checks.RELEASE_MISMATCH, "timed out waiting for release.json", False),
        (checks.RELEASE_MISMATCH, "challenge.json is not a challenge", False),
    ],
)  # fmt: skip
def test_stale_and_replay_reasons_match_either_servers_wording(
    reason: checks.Reason, message: str, said: bool
) -> None:
    check = checks.check_error_phase(
        make_error(phase="capture barrier", error=message),
        expect_phase="capture barrier", expect_reason=reason,
    )  # fmt: skip
    assert (check.status == "passed") is said, check.evidence
    if not said:
        assert check.evidence.startswith(f"reason does not mention {reason.meaning!r}")


def test_fail_closed_observations() -> None:
    assert checks.check_never_validated(["recovering"]).status == "passed"
    validated = checks.check_never_validated(["recovering", "validated"])
    assert validated.status == "failed" and "the fault was not detected" in validated.evidence

    assert checks.check_exited(True, 0.2, 30).status == "passed"
    killed = checks.check_exited(False, None, 30)
    assert killed.status == "failed" and killed.evidence.startswith("still running 30 s")
    # A short --timeout bounds the wait: the evidence names the wait that was made.
    short = checks.check_exited(False, None, 5)
    assert short.evidence.startswith("still running 5 s")
    unwaited = checks.check_exited(False, None, None)
    assert unwaited.status == "failed" and "validated" in unwaited.evidence

    assert checks.check_no_listener([], 12).status == "passed"
    listening = checks.check_no_listener(["00000000:8000"], 12)
    assert listening.status == "failed" and "00000000:8000" in listening.evidence
    unwatched = checks.check_no_listener([], 0)
    assert unwatched.status == "failed" and "could not be watched" in unwatched.evidence


def test_fault_confined() -> None:
    good = checks.check_fault_confined("a" * 64, "a" * 64, "b" * 64, "/m/w")
    assert good.status == "passed"
    leaked = checks.check_fault_confined("a" * 64, "c" * 64, "b" * 64, "/m/w")
    assert leaked.status == "failed" and leaked.evidence.startswith("the host's /m/w changed")
    no_fault = checks.check_fault_confined("a" * 64, "a" * 64, "a" * 64, "/m/w")
    assert no_fault.status == "failed" and "no fault" in no_fault.evidence
    unread = checks.check_fault_confined("a" * 64, "a" * 64, None, "/m/w")
    assert unread.status == "failed" and "could not read" in unread.evidence


def test_criu_fault_checks() -> None:
    ok = checks.check_failed_with("criu restore failed: x", "criu restore failed", "restore")
    assert ok.status == "passed"
    succeeded = checks.check_failed_with(None, "criu restore failed", "restore")
    assert succeeded.status == "failed" and "succeeded despite the injected fault" in (
        succeeded.evidence
    )
    other = checks.check_failed_with("image missing", "criu restore failed", "restore")
    assert other.status == "failed" and "does not say 'criu restore failed'" in other.evidence

    assert checks.check_not_published(False, [], "/i").status == "passed"
    assert checks.check_not_published(True, [], "/i").evidence == "/i exists after a failed dump"
    staging = checks.check_not_published(False, ["/.i.staging-1"], "/i")
    assert staging.status == "failed" and "/.i.staging-1" in staging.evidence

    assert checks.check_image_restores(None, "served").status == "passed"
    assert checks.check_image_restores("criu restore failed", "").status == "failed"
    assert checks.check_completed(None).status == "passed"
    assert checks.check_completed("boom\n  detail").evidence == "boom detail"


# -- lazy copies ----------------------------------------------------------------------------------


def test_pages_complete() -> None:
    done = checks.check_pages_complete(make_pages(), daemon_pid=41, complete_when_ready=False)
    assert done.status == "passed"
    assert done.evidence.startswith("lazy-pages daemon 41 exited 0 300 ms after the restore")
    assert "(after the copy was ready)" in done.evidence

    still = checks.check_pages_complete(
        make_pages(state="transferring", complete_s=None, complete_at=None), daemon_pid=41,
        complete_when_ready=False,
    )  # fmt: skip
    assert still.status == "failed" and still.evidence == (
        "the transfer was still transferring at shutdown"
    )
    died = checks.check_pages_complete(
        make_pages(state="failed", complete_s=None, failure=FAILURE), daemon_pid=41,
        complete_when_ready=False,
    )  # fmt: skip
    assert died.status == "failed" and died.evidence.startswith("lazy-pages daemon killed")
    plain = checks.check_pages_complete(None, daemon_pid=None, complete_when_ready=None)
    assert plain.status == "failed" and "not restored lazily" in plain.evidence
    unwaited = checks.check_pages_complete(None, daemon_pid=41, complete_when_ready=False)
    assert unwaited.status == "failed" and "never waited for" in unwaited.evidence


def test_retained_memory_equals_the_donors() -> None:
    same = checks.check_retained_memory(make_retained(), make_retained(), "donor")
    assert same.name == "retained memory = donor" and same.status == "passed"
    assert same.evidence == "256 MiB hash to the donor's sha256 dddddddddddd…"

    zeroed = checks.check_retained_memory(make_retained(sha256="0" * 64), make_retained(), "donor")
    assert zeroed.status == "failed" and zeroed.evidence == (
        "sha256 000000000000… of 256 MiB, the donor's dddddddddddd… of 256 MiB"
    )
    absent = make_retained(status=404, sha256=None, mb=None)
    assert checks.check_retained_memory(absent, absent, "reference").status == "skipped"
    # The endpoint answered for the donor: a copy answering 404 lost it, which is no skip.
    lost = checks.check_retained_memory(absent, make_retained(), "donor")
    assert lost.status == "failed" and "answered 404" in lost.evidence
    unread = checks.check_retained_memory(None, make_retained(), "donor")
    assert unread.status == "failed" and "the pages never completed" in unread.evidence
    unknown = checks.check_retained_memory(make_retained(), None, "donor")
    assert unknown.status == "failed" and "the donor's digest is unknown" in unknown.evidence
    broken = make_retained(status=500, sha256=None, error="engine gone")
    failed = checks.check_retained_memory(broken, make_retained(), "donor")
    assert failed.status == "failed" and "answered 500: engine gone" in failed.evidence


def test_transfer_running_when_killed() -> None:
    assert checks.check_transfer_running(True, 1, 41).status == "passed"
    retried = checks.check_transfer_running(True, 2, 41)
    assert retried.status == "passed" and "on attempt 2" in retried.evidence

    ended = checks.check_transfer_running(False, 3, 41)

    assert ended.status == "failed"
    expected = "the lazy-pages daemon could not be paused with pages missing (3"
    assert ended.evidence.startswith(expected)
    assert "lazy-pages.log" in ended.evidence


def test_copy_stopped_at_once() -> None:
    stopped = checks.check_copy_stopped(True, 0.008, [], 10)
    assert stopped.status == "passed" and stopped.evidence.startswith("the copy's tree was gone 8")

    running = checks.check_copy_stopped(False, None, [], 10)
    assert running.status == "failed" and running.evidence == (
        "the copy's root still ran 10 s after its daemon was killed"
    )
    stragglers = checks.check_copy_stopped(True, 0.008, [77], 10)
    assert stragglers.status == "failed" and "[77]" in stragglers.evidence


@pytest.mark.parametrize(
    ("failure", "pages", "raised", "failure_file", "message"),
    [
        (None, make_pages(state="failed", failure=FAILURE), FAILURE, FAILURE,
         "Session.failure is empty"),
        ("lazy-pages daemon exited with status 1 before…", make_pages(state="failed"), FAILURE,
         FAILURE, "Session.failure does not say 'killed by SIGKILL'"),
        (FAILURE, make_pages(), FAILURE, FAILURE, "the transfer's status is complete"),
        (FAILURE, make_pages(state="failed"), None, FAILURE, "the start did not fail"),
        (FAILURE, make_pages(state="failed"), "activation failed: the server exited", FAILURE,
         "the start's error does not name the cause"),
        (FAILURE, make_pages(state="failed"), f"{FAILURE}: the server exited", None,
         "the activation's logs have no failure.txt"),
    ],
)  # fmt: skip
def test_failure_reported(
    failure: str | None,
    pages: PagesStatus,
    raised: str | None,
    failure_file: str | None,
    message: str,
) -> None:
    reported = checks.check_failure_reported(
        FAILURE, make_pages(state="failed", failure=FAILURE), f"{FAILURE}: the server exited",
        FAILURE + "\n",
    )  # fmt: skip
    assert reported.status == "passed" and "killed by SIGKILL" in reported.evidence

    check = checks.check_failure_reported(failure, pages, raised, failure_file)

    assert check.status == "failed" and check.evidence.startswith(message), check.evidence


def test_image_usable() -> None:
    assert checks.check_image_usable(None).status == "passed"
    busy = checks.check_image_usable("image /img is in use (a running copy may still read it)")
    assert busy.status == "failed" and "in use" in busy.evidence
