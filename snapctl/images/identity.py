"""What a restore depends on outside the image (kernel and its features, CRIU, CPU, server
argv, Python, and every file the captured tree had mapped or open), what is recorded only to be
shown (machine id, hostname, the server's environment), how both are read from a running tree
and from this host, and how two records are compared.

The record is taken just before the dump and checked by every copy before CRIU runs. Fields a
restored tree runs on refuse a copy that differs (some may be waived by name); fields that only
describe where and how the capture ran are shown as notes and never refuse: a fleet restores on
other machines, from shells, units and pods whose environment is not the capture's, and a
restored tree keeps the environment it was captured with whatever the restorer's is.

A difference names the field (and the file or variable), never a value that could be secret:
environment values are stored only as salted sha256, argv with secret flags redacted.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import posixpath
import secrets
import stat
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from snapctl.errors import ExitStatus, SnapctlError
from snapctl.phases import HostPhase
from snapctl.protocol.atomic import replace_file

CHUNK = 4 << 20

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

# Variables that differ between two shells of one host without changing what a server does;
# recording them would refuse every copy started from another terminal or test.
VOLATILE_ENV = frozenset(
    {
        "_", "PWD", "OLDPWD", "SHLVL", "TERM", "TERM_PROGRAM", "TERM_PROGRAM_VERSION",
        "COLORTERM", "COLUMNS", "LINES", "LS_COLORS", "PS1", "PS2", "PROMPT_COMMAND",
        "HISTFILE", "HISTSIZE", "HISTCONTROL", "MAIL", "DISPLAY", "WINDOWID", "TMUX",
        "TMUX_PANE", "STY", "WINDOW", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY",
        "SSH_AUTH_SOCK", "SSH_AGENT_PID", "XDG_SESSION_ID", "XDG_SESSION_TYPE",
        "XDG_SESSION_CLASS", "XDG_RUNTIME_DIR", "XDG_VTNR", "INVOCATION_ID", "JOURNAL_STREAM",
        "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "PYTEST_VERSION",
    }
)  # fmt: skip
# Variables snapctl derives for the bundled fixture from its own options, and the settings of
# snapctl and CRIU themselves (state directory, CRIU path, CRIU_FAULT): never recorded.
DERIVED_ENV = frozenset({"FIXTURE_API_KEY"})
TOOL_ENV_PREFIXES = ("SNAPCTL_", "CRIU_")

# Paths whose contents are the activation's own (bind-mounted per activation, a private tmpfs
# in the sandbox) or not files at all.
EXCLUDED_PREFIXES = ("/run/", "/dev/", "/proc/", "/sys/", "/memfd:")

# Instruction-set extensions restored code may have chosen at startup (x86 and arm64 names).
# Only these are compared: kernel-only and virtualization flags differ between hosts of one
# CPU model without changing which instructions run.
ISA_FLAG_PREFIXES = (
    "sse", "ssse", "pni", "avx", "amx", "fma", "f16c", "bmi", "sha", "aes", "vaes", "gfni",
    "pclmul", "vpclmul", "popcnt", "abm", "lzcnt", "movbe", "adx", "rdrand", "rdseed", "erms",
    "fsrm", "xsave", "clflushopt", "clwb", "cx16", "mmx", "asimd", "sve", "atomics", "fphp",
    "i8mm", "bf16",
)  # fmt: skip

# Kernel features a restore by snapctl relies on, probed without running CRIU: the namespaces
# every copy gets fresh (and the ones CRIU restores into), and userfaultfd for lazy copies.
# Compared as a set: each recorded feature must be present here, a newer kernel may add more.
NAMESPACE_FEATURES = ("cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts")


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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FileRecord(_Strict):
    """One file outside the image that the captured tree had mapped or open."""

    path: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Identity(_Strict):
    """Everything outside the image a restore depends on (see the module docstring)."""

    version: Literal[1] = 1
    kernel: str
    # None in images captured before features were recorded: not compared.
    kernel_features: list[str] | None = None
    criu_version: str
    cpu_vendor: str
    cpu_model: str  # shown, not compared: flags decide what restored code can execute
    cpu_flags: list[str]
    host_id: str  # shown, never refuses: a fleet restores on other machines
    hostname: str  # shown, never refuses
    python_version: str
    argv: list[str]
    env_salt: str
    # name -> sha256(salt, name, value): the server's environment at capture, shown; the
    # restorer's differing from it never refuses (the restored tree keeps this one).
    env: dict[str, str]
    files: list[FileRecord]


class Difference(_Strict):
    """One way this host differs from the recorded identity (never a secret value).

    ``refuses``: the copy is refused unless ``waivable`` and waived; otherwise only shown.
    """

    field: str
    detail: str
    waivable: bool
    refuses: bool = True


# --- reading this host ------------------------------------------------------------------------


def _cpuinfo() -> tuple[str, str, list[str]]:
    vendor = model = ""
    flags: list[str] = []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine(), "", []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key in ("vendor_id", "CPU implementer") and not vendor:
            vendor = value
        elif key in ("model name", "Processor") and not model:
            model = value
        elif key in ("flags", "Features") and not flags:
            flags = value.split()
    relevant = sorted({f for f in flags if f.startswith(ISA_FLAG_PREFIXES)})
    return vendor or platform.machine(), model, relevant


def kernel_features() -> list[str]:
    """The features of this kernel a restore relies on (see :data:`NAMESPACE_FEATURES`)."""
    found = [f"{name}_ns" for name in NAMESPACE_FEATURES if os.path.exists(f"/proc/self/ns/{name}")]
    # The sysctl exists exactly when the kernel was built with userfaultfd (lazy pages).
    if os.path.exists("/proc/sys/vm/unprivileged_userfaultfd"):
        found.append("userfaultfd")
    return sorted(found)


def host_id() -> str:
    """The machine id (systemd's ``/etc/machine-id``), or ``unknown``."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value:
            return value
    return "unknown"


def env_digest(salt: str, name: str, value: str) -> str:
    """The recorded form of one variable: salted, so a short or guessable value cannot be
    looked up in a table built for another image."""
    return hashlib.sha256(f"{salt}\0{name}\0{value}".encode(errors="surrogateescape")).hexdigest()


def hashed_env(env: Mapping[str, str], salt: str) -> dict[str, str]:
    """Name -> salted digest of every variable a restore can depend on."""
    return {
        name: env_digest(salt, name, value)
        for name, value in sorted(env.items())
        if name not in VOLATILE_ENV
        and name not in DERIVED_ENV
        and not name.startswith(TOOL_ENV_PREFIXES)
    }


def current_identity(
    *,
    criu_version: str,
    argv: list[str],
    env: Mapping[str, str],
    files: Iterable[str],
    cache_dir: Path | None,
    env_salt: str | None = None,
) -> Identity:
    """This host's identity; ``files`` are hashed here (in parallel, cached by stat).

    At capture ``files`` are those the tree had mapped or open and ``env_salt`` is new; at
    restore both come from the recorded identity, so the records compare field by field.
    """
    vendor, model, flags = _cpuinfo()
    salt = env_salt if env_salt is not None else secrets.token_hex(16)
    return Identity(
        kernel=platform.release(),
        kernel_features=kernel_features(),
        criu_version=criu_version,
        cpu_vendor=vendor,
        cpu_model=model,
        cpu_flags=flags,
        host_id=host_id(),
        hostname=platform.node(),
        python_version=platform.python_version(),
        argv=list(argv),
        env_salt=salt,
        env=hashed_env(env, salt),
        files=hash_files(sorted(set(files)), cache_dir),
    )


# --- reading a process tree -------------------------------------------------------------------


def _candidate(path: str) -> bool:
    return (
        path.startswith("/")
        and not path.endswith(" (deleted)")
        and not path.startswith(EXCLUDED_PREFIXES)
        and posixpath.normpath(path) == path
    )


def _same_file_on_host(pid: int, path: str) -> bool:
    """True when ``path`` names the same regular file inside the tree's mount namespace as on
    the host: the sandbox shares the host's root, except for its own mounts."""
    try:
        inside = os.stat(f"/proc/{pid}/root{path}")
        outside = os.stat(path)
    except OSError:
        return False
    same = (inside.st_dev, inside.st_ino) == (outside.st_dev, outside.st_ino)
    return same and stat.S_ISREG(outside.st_mode)


def tree_files(pids: Iterable[int]) -> list[str]:
    """Host paths of every regular file the processes have mapped or open (sorted, unique).

    Read from ``/proc/PID/maps`` and ``/proc/PID/fd``; sockets, pipes, anonymous and deleted
    files, the activation's own directories and anything private to the sandbox are left out.
    """
    found: set[str] = set()
    for pid in pids:
        candidates: set[str] = set()
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[4] != "0":
                    candidates.add(fields[5])
        except OSError:
            continue  # exited: its files went with it
        try:
            descriptors = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            descriptors = []
        for fd in descriptors:
            try:
                candidates.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
        found.update(p for p in candidates if _candidate(p) and _same_file_on_host(pid, p))
    return sorted(found)


# --- hashing with a cache ---------------------------------------------------------------------


def _stat_key(st: os.stat_result) -> list[int]:
    # Any write changes ctime, which no unprivileged tool can set back: a key match is as
    # good as a re-hash for the question "is this the file that was recorded".
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _cache_path(cache_dir: Path, path: str) -> Path:
    return cache_dir / f"{hashlib.sha256(path.encode(errors='surrogateescape')).hexdigest()}.json"


def _cached(path: str, cache_dir: Path | None) -> FileRecord | None:
    """The cached record of ``path`` if the file is unchanged since it was hashed, else None."""
    if cache_dir is None:
        return None
    try:
        st = os.stat(path)
        cached = json.loads(_cache_path(cache_dir, path).read_text())
        if cached.get("path") == path and cached.get("key") == _stat_key(st):
            return FileRecord(path=path, size=st.st_size, sha256=cached["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # missing file, no or damaged cache entry: hash (or leave out)
    return None


def _hash_one(path: str, cache_dir: Path | None) -> FileRecord | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = _stat_key(st)
    cache = _cache_path(cache_dir, path) if cache_dir is not None else None
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
            after = os.fstat(handle.fileno())
    except OSError:
        return None
    record = FileRecord(path=path, size=after.st_size, sha256=digest.hexdigest())
    if cache is not None and _stat_key(after) == key:  # not written to while we read it
        try:
            cache.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            entry = {"path": path, "key": key, "sha256": record.sha256}
            replace_file(cache, json.dumps(entry).encode())
        except OSError:
            pass  # a cache we cannot write only costs a re-hash next time
    return record


def hash_files(paths: list[str], cache_dir: Path | None) -> list[FileRecord]:
    """Size and sha256 of each path that exists (missing ones are left out), in parallel."""
    # Cache hits first, one by one: a stat and a small read each (about 2 ms for the ~70 files
    # of a server), where handing them to threads cost 10-25 ms on a busy 2-core host, and
    # every copy's identity check pays it.
    found = {path: _cached(path, cache_dir) for path in paths}
    misses = [path for path, record in found.items() if record is None]
    if misses:
        # hashlib releases the GIL: a few threads keep every core and the disk busy.
        with ThreadPoolExecutor(max_workers=min(8, len(misses))) as pool:
            hashed = pool.map(lambda p: _hash_one(p, cache_dir), misses)
            found.update(zip(misses, hashed, strict=True))
    return [record for path in paths if (record := found[path]) is not None]


# --- comparing --------------------------------------------------------------------------------


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
