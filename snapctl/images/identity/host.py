"""Reading this host's identity: kernel and its features, CPU, Python, machine id, hostname,
and the server's environment as salted digests (the files come from
:mod:`snapctl.images.identity.tree`)."""

from __future__ import annotations

import hashlib
import os
import platform
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path

from snapctl.images.identity.models import Identity
from snapctl.images.identity.tree import FileView, hash_files

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
    view: FileView | None = None,
) -> Identity:
    """This host's identity; ``files`` are hashed here (in parallel, cached by stat).

    At capture ``files`` are those the tree had mapped or open and ``env_salt`` is new; at
    restore both come from the recorded identity, so the records compare field by field.
    ``view``: where ``files`` are read (a container's files; None: this host's ``/``).
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
        files=hash_files(sorted(set(files)), cache_dir, view=view),
    )
