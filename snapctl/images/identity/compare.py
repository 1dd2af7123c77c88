"""Comparing a recorded identity with this host's: which differences refuse a copy, which may
be waived by name (``--allow-mismatch``), which are only shown, and the refusal itself."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from snapctl.errors import ExitStatus, SnapctlError
from snapctl.images.identity.models import Difference, Identity
from snapctl.phases import HostPhase

# Fields that refuse a copy when they differ, yet a platform team may waive by name
# (``--allow-mismatch FIELD``). File contents are not among them: a restored tree that maps a
# changed library or model runs on bytes it never validated.
REFUSING_WAIVABLE_FIELDS = (
    "kernel",
    "kernel_features",
    "criu_version",
    "cpu_vendor",
    "cpu_flags",
    "python_version",
    "argv",
    "identity",  # a schema-1 image, which recorded none of this
)
# Fields shown when they differ but never refusing: the machine (a fleet restores elsewhere)
# and the restorer's environment (the restored tree keeps the one it was captured with).
NOTED_FIELDS = ("host_id", "hostname", "env")
# Every name ``--allow-mismatch`` accepts: a waiver of a noted field (an older script's
# ``--allow-mismatch host_id``) is accepted and has nothing left to waive.
WAIVABLE_FIELDS = (*REFUSING_WAIVABLE_FIELDS, "host_id", "env")
FILES_FIELD = "files"


class IdentityMismatchError(SnapctlError):
    """This host differs from the one the image was captured on in a way not waived."""

    exit_status = ExitStatus.VERIFY_FAILED

    def __init__(self, differences: list[Difference], *, path: Path | None = None) -> None:
        lines = [f"  {d.field}: {d.detail}" for d in differences]
        waivable = sorted({d.field for d in differences if d.waivable})
        hint = ""
        if waivable:
            hint = " (waive with " + " ".join(f"--allow-mismatch {f}" for f in waivable) + ")"
        super().__init__(
            f"this host does not match the image's identity{hint}:\n" + "\n".join(lines),
            phase=HostPhase.IDENTITY,
            path=path,
        )
        self.differences = differences


def _argv_detail(recorded: list[str], current: list[str]) -> str:
    for index, (a, b) in enumerate(zip(recorded, current, strict=False)):
        if a != b:
            return f"argument {index} differs (image {a!r}, here {b!r})"
    return f"the image ran {len(recorded)} arguments, this copy names {len(current)}"


def compare(recorded: Identity, current: Identity) -> list[Difference]:
    """Every difference between the recorded identity and this host's (empty: identical)."""
    out: list[Difference] = []

    def differ(field: str, detail: str) -> None:
        out.append(
            Difference(
                field=field,
                detail=detail,
                waivable=field in WAIVABLE_FIELDS,
                refuses=field not in NOTED_FIELDS,
            )
        )

    for field in ("kernel", "criu_version", "cpu_vendor", "python_version"):
        was, now = getattr(recorded, field), getattr(current, field)
        if was != now:
            differ(field, f"image {was}, here {now}")
    if recorded.kernel_features is not None and current.kernel_features is not None:
        missing_features = sorted(set(recorded.kernel_features) - set(current.kernel_features))
        if missing_features:
            differ("kernel_features", "this kernel lacks " + " ".join(missing_features))
    missing_flags = sorted(set(recorded.cpu_flags) - set(current.cpu_flags))
    if missing_flags:
        differ("cpu_flags", "this CPU lacks " + " ".join(missing_flags))
    if recorded.argv != current.argv:
        differ("argv", _argv_detail(recorded.argv, current.argv))
    if recorded.host_id != current.host_id:
        # machine-id is meant to stay confidential (machine-id(5)): a prefix tells the
        # machines apart without handing the whole id to whoever reads the output.
        differ("host_id", f"image {recorded.host_id[:8]}..., here {current.host_id[:8]}...")
    if recorded.hostname != current.hostname:
        differ("hostname", f"image {recorded.hostname}, here {current.hostname}")
    for name in sorted(set(recorded.env) | set(current.env)):
        if name not in current.env:
            differ("env", f"{name} was set at capture, not here (the copy keeps it)")
        elif name not in recorded.env:
            differ("env", f"{name} is set here but was not at capture (the copy does not see it)")
        elif recorded.env[name] != current.env[name]:
            differ("env", f"{name} has another value here (the copy keeps the captured one)")
    now_files = {record.path: record for record in current.files}
    for record in recorded.files:
        here = now_files.get(record.path)
        if here is None:
            differ(FILES_FIELD, f"{record.path} is missing")
        elif here.size != record.size:
            differ(FILES_FIELD, f"{record.path} changed size ({record.size} -> {here.size} bytes)")
        elif here.sha256 != record.sha256:
            differ(FILES_FIELD, f"{record.path} has other content (sha256 differs)")
    return out


def needless_waivers(allow: Iterable[str]) -> list[str]:
    """The ``--allow-mismatch`` names that waive nothing: fields that never refuse a copy."""
    return sorted({name for name in allow if name in NOTED_FIELDS})


def check_waivers(allow: Iterable[str]) -> list[str]:
    """Validate ``--allow-mismatch`` names; file contents can never be waived."""
    names = list(allow)
    for name in names:
        if name == FILES_FIELD:
            raise SnapctlError(
                "file content mismatches cannot be waived: restore the recorded files",
                phase=HostPhase.IDENTITY,
            )
        if name not in WAIVABLE_FIELDS:
            raise SnapctlError(
                f"unknown identity field {name!r} (waivable: {', '.join(WAIVABLE_FIELDS)})",
                phase=HostPhase.IDENTITY,
            )
    return names


def require_match(
    recorded: Identity | None,
    current: Identity | None,
    *,
    allow: Iterable[str] = (),
    path: Path | None = None,
) -> list[Difference]:
    """Raise :class:`IdentityMismatchError` listing every refusing difference that is not
    waived; return the others, waived or only noted (the caller shows them)."""
    waived_fields = set(check_waivers(allow))
    if recorded is None or current is None:
        differences = [
            Difference(
                field="identity",
                detail="the image records no identity (schema 1): re-bake it",
                waivable=True,
            )
        ]
    else:
        differences = compare(recorded, current)
    refused = [
        d for d in differences if d.refuses and not (d.waivable and d.field in waived_fields)
    ]
    if refused:
        raise IdentityMismatchError(refused, path=path)
    return differences
