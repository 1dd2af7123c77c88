"""Every qualification check, as a pure function from observations to a :class:`Check`.

A check never does I/O: runs observe, checks judge. Each returns ``passed``, ``failed`` or
``skipped`` with one line of evidence; a failure names what differed (the request, the token
position, the file, the phase), a pass says what was compared.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from snapctl.activation.session import CleanupAudit
from snapctl.criu.lazy.transfer import PagesStatus
from snapctl.images.manifest import FileEntry
from snapctl.models import StrictModel
from snapctl.protocol.models import ErrorReport
from snapctl.qualification.watch import Residue
from snapctl.qualification.workload import (
    Completion,
    DigestRead,
    Group,
    RetainedRead,
    ServingObservation,
)

LOGPROB_TOLERANCE = 1e-3

Status = Literal["passed", "failed", "skipped"]


class Check(StrictModel):
    """One check's outcome and the evidence for it."""

    name: str
    status: Status
    evidence: str

    @property
    def failed(self) -> bool:
        return self.status == "failed"


def passed(name: str, evidence: str) -> Check:
    return Check(name=name, status="passed", evidence=evidence)


def failed(name: str, evidence: str) -> Check:
    return Check(name=name, status="failed", evidence=evidence)


def skipped(name: str, evidence: str) -> Check:
    return Check(name=name, status="skipped", evidence=evidence)


# -- serving --------------------------------------------------------------------------------------


def completion_difference(
    expected: Completion, got: Completion, tolerance: float = LOGPROB_TOLERANCE
) -> str | None:
    """How ``got`` differs from the reference completion, or None when it matches."""
    label = expected.label
    if got.error is not None:
        return f"{label}: request failed: {got.error}"
    if expected.token_ids is not None or got.token_ids is not None:
        if expected.token_ids is None or got.token_ids is None:
            return f"{label}: token ids returned by only one side"
        for position, (want, have) in enumerate(
            zip(expected.token_ids, got.token_ids, strict=False)
        ):
            if want != have:
                return f"{label}: token {position} differs: expected id {want}, got {have}"
        if len(expected.token_ids) != len(got.token_ids):
            return f"{label}: {len(got.token_ids)} tokens, expected {len(expected.token_ids)}"
    if got.text != expected.text:
        return f"{label}: text differs: expected {expected.text!r}, got {got.text!r}"
    if len(got.logprobs) != len(expected.logprobs):
        return f"{label}: {len(got.logprobs)} logprobs, expected {len(expected.logprobs)}"
    for position, (want_lp, have_lp) in enumerate(
        zip(expected.logprobs, got.logprobs, strict=True)
    ):
        delta = abs(want_lp - have_lp)
        if not delta <= tolerance:  # also catches NaN
            return (
                f"{label}: logprob of token {position} differs by {delta:.3g} "
                f"(> {tolerance:g}): expected {want_lp:.6f}, got {have_lp:.6f}"
            )
    return None


def check_outputs(
    group: Group,
    reference: ServingObservation,
    observed: ServingObservation,
    tolerance: float = LOGPROB_TOLERANCE,
) -> Check:
    """Every completion of ``group`` matches the ordinary reference: ids, text, logprobs."""
    name = {"prompts": "prompts match reference", "concurrency": "concurrency matches reference"}[
        group
    ]
    expected = [c for c in reference.completions.values() if c.group == group]
    if not expected:
        return failed(name, "the reference has no completions to compare")
    broken = [c.label for c in expected if c.error is not None]
    if broken:
        return failed(name, f"reference request failed: {broken[0]}")
    differences = []
    max_delta = 0.0
    tokens = 0
    for want in expected:
        got = observed.completions.get(want.label)
        if got is None:
            differences.append(f"{want.label}: not sent")
            continue
        difference = completion_difference(want, got, tolerance)
        if difference is not None:
            differences.append(difference)
            continue
        tokens += len(got.logprobs)
        deltas = [abs(a - b) for a, b in zip(want.logprobs, got.logprobs, strict=True)]
        max_delta = max([max_delta, *deltas])
    if differences:
        more = f" (and {len(differences) - 1} more)" if len(differences) > 1 else ""
        return failed(name, differences[0] + more)
    ids = "token ids, " if all(c.token_ids is not None for c in expected) else ""
    return passed(
        name,
        f"{len(expected)} completions, {tokens} tokens: same {ids}text; "
        f"max |Δ logprob| {max_delta:.2g} (≤ {tolerance:g})",
    )


AUTH_CHECK = "API key enforced"


def check_auth(auth: Mapping[str, int], *, keyless_hint: str = "") -> Check:
    """A missing and a wrong API key get 401, the right one 200. A server that answers 200
    without a key was started without one: the evidence says so, then ``keyless_hint`` (how
    to give it one, or to qualify it without one on purpose)."""
    want = {"missing": 401, "wrong": 401, "right": 200}
    shown = ", ".join(f"{k} key → {auth.get(k, 0) or 'no answer'}" for k in want)
    wrong = [k for k, status in want.items() if auth.get(k) != status]
    if wrong:
        first = wrong[0]
        why = ""
        if auth.get("missing") == 200:
            why = "; the server serves without an API key: it was started without one"
            why += f". {keyless_hint}" if keyless_hint else ""
        return failed(
            AUTH_CHECK, f"{first} key got {auth.get(first, 0) or 'no answer'}, expected "
            f"{want[first]} ({shown}){why}",
        )  # fmt: skip
    return passed(AUTH_CHECK, shown)


def auth_skipped() -> Check:
    """The API key checks, skipped because the qualification was asked to run without a key."""
    return skipped(
        AUTH_CHECK,
        "skipped by request (--no-api-key): qualified without an API key, none given to the "
        "server or sent",
    )


def check_digests_stable(reads: Iterable[DigestRead], baseline: Iterable[DigestRead]) -> Check:
    """The named-parameter digests are identical in every read (this run's and the reference's)."""
    name = "parameter digests stable"
    every = [*baseline, *reads]
    if not every:
        return failed(name, "no digest read was made")
    if all(read.status == 404 for read in every):
        return skipped(name, "skipped (endpoint absent)")
    for read in every:
        if read.status != 200 or read.digests is None:
            return failed(name, f"a digest read answered {read.status or 'nothing'}: {read.error}")
    first = every[0].digests
    assert first is not None
    for index, read in enumerate(every[1:], start=1):
        assert read.digests is not None
        difference = _digest_difference(first, read.digests)
        if difference:
            return failed(name, f"read {index} differs from read 0: {difference}")
    return passed(name, f"{len(every)} reads identical ({len(first)} tensors)")


def check_digests_match_model(
    reads: Iterable[DigestRead], model: Mapping[str, str] | None
) -> Check:
    """The digests the server reports equal the digests of the model file on disk."""
    return _served_digests_equal(
        "parameter digests = model file", reads, model,
        unknown="the model file's digests are not known for this server",
        source="model file", equal="equal the model file's sha256",
    )  # fmt: skip


def check_digests_match_capture(
    reads: Iterable[DigestRead], captured: Mapping[str, str] | None
) -> Check:
    """The digests the server reports equal the first load's, recorded in the image."""
    return _served_digests_equal(
        "parameter digests = image's first load", reads, captured,
        unknown="the server recorded no digests in the image",
        source="recorded at capture", equal="equal the digests recorded at capture",
    )  # fmt: skip


def _served_digests_equal(
    name: str, reads: Iterable[DigestRead], expected: Mapping[str, str] | None, *,
    unknown: str, source: str, equal: str,
) -> Check:  # fmt: skip
    """The first successful read equals ``expected``; skipped without the endpoint, or where
    ``expected`` is None (``unknown`` says why)."""
    reads = list(reads)
    if reads and all(read.status == 404 for read in reads):
        return skipped(name, "skipped (endpoint absent)")
    if expected is None:
        return skipped(name, f"skipped ({unknown})")
    served = next((r.digests for r in reads if r.digests is not None), None)
    if served is None:
        return failed(name, "no digest read succeeded")
    difference = _digest_difference(dict(expected), served)
    if difference:
        return failed(name, f"served vs {source}: {difference}")
    return passed(name, f"{len(expected)} tensors {equal}")


def _digest_difference(expected: Mapping[str, str], got: Mapping[str, str]) -> str | None:
    missing = sorted(set(expected) - set(got))
    if missing:
        return f"tensor {missing[0]} missing"
    extra = sorted(set(got) - set(expected))
    if extra:
        return f"unexpected tensor {extra[0]}"
    for tensor in sorted(expected):
        if expected[tensor] != got[tensor]:
            return f"tensor {tensor}: {got[tensor][:12]}… instead of {expected[tensor][:12]}…"
    return None


# -- image and cleanup ----------------------------------------------------------------------------


def check_image_unchanged(
    before: Mapping[str, FileEntry] | None, after: Mapping[str, FileEntry] | None
) -> Check:
    """Every image file has the same size, sha256 and hard links after the run as before."""
    name = "image unchanged"
    if before is None:
        return failed(name, "the image could not be hashed before the run")
    if after is None:
        return failed(name, "the image could not be hashed after the run")
    missing = sorted(set(before) - set(after))
    if missing:
        return failed(name, f"{missing[0]} disappeared")
    extra = sorted(set(after) - set(before))
    if extra:
        return failed(name, f"{extra[0]} appeared")
    for file in sorted(before):
        if before[file] != after[file]:
            was, now = before[file], after[file]
            what = "sha256" if was.sha256 != now.sha256 else "size or hard links"
            return failed(name, f"{file}: {what} changed")
    total = sum(entry.size for entry in before.values())
    return passed(
        name, f"{len(before)} files ({total / 1e6:.1f} MB) hash the same before and after"
    )


def check_cleanup(audit: CleanupAudit | None, residue: Residue, how: str | None = None) -> Check:
    """Nothing of the run is left: processes, listeners, mounts, directories, /dev/shm files.
    ``how`` (the stop's "terminated", "killed", "exited") is named in the evidence."""
    name = "nothing left behind"
    problems = []
    if audit is not None and not audit.clean:
        problems.append(f"stop audit: {audit.describe()}")
    if not residue.clean:
        problems.append(residue.describe())
    if problems:
        return failed(name, "; ".join(problems))
    stopped = f"{how}; " if how else ""
    if audit is None:
        # Without a session there is no published port to look at: the scan has no listeners.
        return passed(
            name, f"{stopped}host scan: no process, mount, directory, link remap or /dev/shm file"
        )
    return passed(
        name,
        f"{stopped}stop audit and host scan: no process, listener, mount, directory, link remap "
        "or /dev/shm file",
    )


def check_link_remaps(remaps: list[str]) -> Check:
    """While serving, no ``link_remap.*`` file is left in the activation's /dev/shm."""
    name = "no leftover link remap"
    if remaps:
        return failed(name, f"{len(remaps)} left in the activation's /dev/shm: {remaps[0]}")
    return passed(name, "the activation's /dev/shm holds no link_remap.* file while serving")


# -- lazy copies ----------------------------------------------------------------------------------


def check_pages_complete(
    pages: PagesStatus | None, *, daemon_pid: int | None, complete_when_ready: bool | None
) -> Check:
    """The lazy-pages daemon exited 0 (every page copied) before the run's shutdown."""
    name = "pages complete"
    if daemon_pid is None:
        return failed(name, "the copy was not restored lazily (no lazy-pages daemon)")
    if pages is None:
        return failed(name, "the transfer was never waited for (an earlier step failed)")
    if pages.state == "failed":
        return failed(name, _clip(pages.failure or "the lazy-pages daemon failed"))
    if pages.state != "complete":
        return failed(name, f"the transfer was still {pages.state} at shutdown")
    if pages.complete_s is None:
        return failed(name, "the daemon exited 0 but its completion time was not recorded")
    when = "after" if complete_when_ready is False else "by the time"
    return passed(
        name,
        f"lazy-pages daemon {daemon_pid} exited 0 {pages.complete_s * 1000:.0f} ms after the "
        f"restore started, before shutdown ({when} the copy was ready)",
    )


def check_retained_memory(
    read: RetainedRead | None, baseline: RetainedRead | None, baseline_name: str
) -> Check:
    """Once the pages are complete, the retained memory hashes as the donor's (or reference's)."""
    name = "retained memory = " + baseline_name
    if read is None:
        return failed(name, "not read: the pages never completed")
    if read.status == 404 and (baseline is None or baseline.status == 404):
        return skipped(name, "skipped (endpoint absent)")
    if read.status != 200 or read.sha256 is None:
        return failed(name, f"the read answered {read.status or 'nothing'}: {read.error}")
    if baseline is None or baseline.status != 200 or baseline.sha256 is None:
        shown = "not read" if baseline is None else f"answered {baseline.status or 'nothing'}"
        return failed(name, f"the {baseline_name}'s digest is unknown ({shown})")
    if read.sha256 != baseline.sha256:
        return failed(
            name,
            f"sha256 {read.sha256[:12]}… of {_mib(read.mb)}, the {baseline_name}'s "
            f"{baseline.sha256[:12]}… of {_mib(baseline.mb)}",
        )
    return passed(name, f"{_mib(read.mb)} hash to the {baseline_name}'s sha256 {read.sha256[:12]}…")


def _mib(mb: float | None) -> str:
    return "? MiB" if mb is None else f"{mb:g} MiB"


def check_transfer_running(paused: bool, attempts: int, daemon_pid: int | None) -> Check:
    """The lazy-pages daemon was still transferring when it was paused (and then killed)."""
    name = "transfer running when killed"
    tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
    if not paused or daemon_pid is None:
        return failed(
            name,
            f"the lazy-pages daemon could not be paused with pages missing ({tries}): it "
            "exited, or its held transfer started (2 s after the restore) before the pause; "
            "its lazy-pages.log says which",
        )
    again = "" if attempts == 1 else f" (on attempt {attempts}: earlier ones could not be paused)"
    return passed(
        name,
        f"lazy-pages daemon {daemon_pid} paused while still transferring (not exited), its "
        f"transfer released, then SIGKILLed{again}",
    )


def check_copy_stopped(
    exited: bool, kill_to_exit_s: float | None, left: list[int], bound_s: float
) -> Check:
    """Killing the lazy-pages daemon stopped the copy's whole tree at once (snapctl's watcher
    killed it; the run never signalled the tree)."""
    name = "copy stopped at once"
    if not exited or kill_to_exit_s is None:
        return failed(name, f"the copy's root still ran {bound_s:g} s after its daemon was killed")
    if left:
        return failed(name, f"the root exited but {len(left)} of its processes remained: {left}")
    return passed(
        name,
        f"the copy's tree was gone {kill_to_exit_s * 1000:.0f} ms after the daemon's SIGKILL, "
        "killed by snapctl's watcher",
    )


def check_failure_reported(
    failure: str | None,
    pages: PagesStatus | None,
    raised: str | None,
    failure_file: str | None,
    expect_text: str = "killed by SIGKILL",
) -> Check:
    """The daemon's death is reported: ``Session.failure``, the transfer's status, the error the
    start raised, and ``failure.txt`` in the activation's logs all name it."""
    name = "failure reported"
    if failure is None:
        return failed(name, "Session.failure is empty: the daemon's death went unnoticed")
    if expect_text not in failure:
        return failed(name, f"Session.failure does not say {expect_text!r}: {_clip(failure)}")
    if pages is None or pages.state != "failed":
        shown = "none" if pages is None else pages.state
        return failed(name, f"the transfer's status is {shown}, expected failed")
    if raised is None:
        return failed(name, "the start did not fail")
    if failure not in raised:
        return failed(name, f"the start's error does not name the cause: {_clip(raised)}")
    if failure_file is None or failure not in failure_file:
        return failed(name, "the activation's logs have no failure.txt naming the cause")
    return passed(name, f"Session.failure, the start's error and failure.txt: {_clip(failure)}")


def check_image_usable(error: str | None) -> Check:
    """The image still verifies (full re-hash), and an exclusive hold can be taken on it."""
    name = "image verifies and is free"
    if error is not None:
        return failed(name, _clip(error))
    return passed(name, "every sha256 verified again; an exclusive hold was taken and released")


# -- fail closed ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reason:
    """What a server's error must say, in whichever server's words: every one of ``terms``
    (case-insensitive regular expressions, in any order) occurs in the message; ``meaning``
    names it in the evidence."""

    meaning: str
    terms: tuple[str, ...]

    def said_in(self, message: str) -> bool:
        return all(re.search(term, message, re.IGNORECASE) for term in self.terms)


# Stale control files in a fresh activation's directory. The fixture (snapctl's launcher):
# "stale activation control: release.json, status.json already present"; vLLM: "stale
# snapshot activation control: release.json". Either names a file the stale run planted.
STALE_CONTROL = Reason(
    "stale activation control",
    (r"\bstale\b", r"\bactivation control\b", r"\b(release|status)\.json\b"),
)
# A release that answers another challenge. The fixture: "release.json does not match
# challenge.json"; vLLM: "snapshot release does not match this activation challenge".
RELEASE_MISMATCH = Reason(
    "release.json does not match challenge.json",
    (r"\brelease\b", r"\b(does not|doesn't|did not) match\b", r"\bchallenge\b"),
)


def check_error_phase(
    report: ErrorReport | None,
    *,
    expect_phase: str,
    expect_reason: Reason | None = None,
    capturer_saw: str | None = None,
) -> Check:
    """error.json exists and names the expected phase (a prefix: ``recover`` covers
    ``recovery: restore memory``) and, when given, says the expected reason."""
    name = f"error.json at {expect_phase}"
    if report is None:
        seen = f" (the capturer saw: {_clip(capturer_saw, 200)})" if capturer_saw else ""
        return failed(name, f"no error.json was written{seen}")
    summary = f"{report.phase}: {report.error_type}: {report.error}"
    if not report.phase.startswith(expect_phase):
        return failed(name, f"phase {report.phase!r}, expected {expect_phase!r} ({summary})")
    if expect_reason is not None and not expect_reason.said_in(report.error):
        return failed(name, f"reason does not mention {expect_reason.meaning!r}: {summary}")
    return passed(name, _clip(summary))


def check_never_validated(phases: list[str]) -> Check:
    """The activation never reported ``validated``."""
    name = "never validated"
    if "validated" in phases:
        return failed(name, f"status.json went through {phases}: the fault was not detected")
    shown = " → ".join(phases) if phases else "no status.json"
    return passed(name, f"status phases seen: {shown}")


def check_exited(exited: bool, exit_s: float | None, waited_s: float | None) -> Check:
    """The tree exited on its own after error.json (before anyone signalled it).
    ``waited_s``: how long the run waited for that exit (None: it never waited, because the
    activation validated and so would never exit by itself)."""
    name = "tree exited by itself"
    if waited_s is None:
        return failed(name, "not waited for: the activation validated, so it kept running")
    if not exited or exit_s is None:
        return failed(name, f"still running {waited_s:g} s after error.json (it was killed)")
    return passed(name, f"the root exited {exit_s * 1000:.0f} ms after error.json, unsignalled")


def check_no_listener(seen: list[str], polls: int) -> Check:
    """No socket ever listened on the public port during the activation."""
    name = "no public listener"
    if polls == 0:
        return failed(name, "the activation's network namespace could not be watched")
    if seen:
        return failed(name, f"a listener was observed: {seen[0]}")
    return passed(name, f"{polls} polls of the netns's TCP tables saw no listener on the port")


def check_fault_confined(
    host_before: str, host_after: str, inside: str | None, weights: str
) -> Check:
    """The changed weights were seen only inside that activation; the host file is unchanged."""
    name = "fault confined to the activation"
    if host_after != host_before:
        return failed(name, f"the host's {weights} changed (sha256 {host_after[:12]}…)")
    if inside is None:
        return failed(name, f"could not read {weights} inside the copy")
    if inside == host_before:
        return failed(name, f"inside the copy {weights} still has the host's sha256: no fault")
    return passed(name, f"inside sha256 {inside[:12]}…, host {host_before[:12]}… before and after")


def check_memory_fault(tensors: list[str], places: list[str], written: int) -> Check:
    """The memory fault was injected: named tensors overwritten in the copy's memory only."""
    name = "fault injected in the copy's memory"
    if not tensors:
        return failed(name, "no tensor of the weights files was overwritten")
    shown = ", ".join(tensors[:3]) + (", ..." if len(tensors) > 3 else "")
    return passed(name, f"{written} bytes of {shown} at {', '.join(places[:3])}")


# -- CRIU-level faults ----------------------------------------------------------------------------


def check_failed_with(error: str | None, expect_text: str, what: str) -> Check:
    """The operation failed, and its error says ``expect_text``."""
    name = f"{what} failed"
    if error is None:
        return failed(name, f"{what} succeeded despite the injected fault")
    if expect_text not in error:
        return failed(name, f"error does not say {expect_text!r}: {_clip(error)}")
    return passed(name, _clip(error))


def check_not_published(image_exists: bool, staging_left: list[str], image: str) -> Check:
    """No image appeared at the target path and no staging directory was left beside it."""
    name = "no image published"
    if image_exists:
        return failed(name, f"{image} exists after a failed dump")
    if staging_left:
        return failed(name, f"staging directory left beside it: {staging_left[0]}")
    return passed(name, f"{image} absent, no staging directory left")


def check_image_restores(error: str | None, evidence: str) -> Check:
    """After the failed restore, the image still verifies and a fresh restore serves."""
    name = "image still restores"
    if error is not None:
        return failed(name, _clip(error))
    return passed(name, evidence)


def check_completed(error: str | None) -> Check:
    """The run itself completed (a run that raised records why here)."""
    name = "run completed"
    if error is not None:
        return failed(name, _clip(error))
    return passed(name, "every step ran")


def _clip(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"
