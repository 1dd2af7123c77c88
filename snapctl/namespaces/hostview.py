"""Which of the host's mounts a sandbox shows, which it hides, and which host paths it binds in.

A sandbox's mount namespace starts as a copy of the host's, and CRIU records every mount in it:
a host mount the server has no business with would be tarred into the image (a tmpfs) or
recorded as an external host mount a restore must bind back (anything CRIU cannot dump), and
may be gone by then, or never exist on another host. ``ip netns add`` leaves ``/run/netns``
mounted, with an nsfs per namespace under it; Kubernetes nodes make and remove
``/run/netns/cni-*`` all the time. So the sandbox shows the server only what it needs:

- **Private roots** (``/run``, ``/tmp``): every host mount at or below them is detached and a
  fresh tmpfs of the activation's own is mounted there, which CRIU dumps and restores with its
  contents (a unix socket bound there included): two activations never share ``/tmp``, where
  vLLM's ``ipc://`` endpoints live. A host path under ``/tmp`` that the server names (its
  working directory, program, the virtual environment its program runs in, or a path argument
  such as ``--model``) is bound in explicitly (:func:`host_binds`), fully resolved and never
  through a symlink, and recorded as an external host mount, like an undumpable one.
- **Built roots** (``/dev``): every host mount at or below it is detached and the sandbox
  builds its own (``snapctl.namespaces.devices``): a host's devtmpfs and a container's tmpfs
  differ, and an image must restore wherever its copy runs.
- **Other transient places** (container runtimes' state, ``/var/run`` where it is a directory):
  every mount there that holds none of the server's paths is detached.
- **nsfs** (a bound namespace file, as ``ip netns`` makes) is detached wherever it is.
- **A tmpfs elsewhere** holding none of the server's paths is detached too (CRIU would tar it
  and record host paths a copy cannot have).

Everything else (the root, /proc, /sys, a driver tree or data disk) stays: the server may
need it, and the identity gate checks the files it used. :func:`hidden_mounts` is what
``snapctl doctor`` reports.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

PRIVATE_ROOTS = ("/run", "/tmp")
# Replaced by one the sandbox builds (namespaces.devices), whatever the server needs there.
BUILT_ROOTS = ("/dev",)
# Where hosts and container runtimes mount things that come and go.
TRANSIENT_ROOTS = (
    *PRIVATE_ROOTS, "/var/run", "/var/lock", "/var/lib/docker", "/var/lib/containerd",
    "/var/lib/kubelet",
)  # fmt: skip
# Private roots whose host paths a sandbox may bind in: a restore runs CRIU with a /run of its
# own (snapctl.criu.kdat), where the host's /run paths could not be bound back.
BINDABLE_ROOTS = ("/tmp",)
HIDDEN_TYPES = frozenset({"nsfs"})
# Source names of snapctl's own per-activation mounts (namespaces.layout): never reported.
OWN_SOURCE_PREFIX = "snapctl-"


@dataclass(frozen=True)
class HostMount:
    """One line of a mount table: where, what filesystem, and its source."""

    point: str
    fstype: str
    source: str = ""


class PrivatePathError(ValueError):
    """A path the server needs is itself a private root, which each sandbox replaces."""


def is_within(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it (paths absolute and normalised)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def _within_any(path: str, roots: Iterable[str]) -> bool:
    return any(is_within(path, root) for root in roots)


def _holds_any(point: str, paths: Iterable[str]) -> bool:
    return any(is_within(path, point) for path in paths)


def always_hidden(mount: HostMount) -> bool:
    """Whether a sandbox detaches this host mount whatever the server needs."""
    return mount.fstype in HIDDEN_TYPES or _within_any(mount.point, (*PRIVATE_ROOTS, *BUILT_ROOTS))


def hides(mount: HostMount, needed: Iterable[str] = ()) -> bool:
    """Whether a sandbox detaches this host mount (``needed``: the server's own paths)."""
    if always_hidden(mount):
        return True
    if _within_any(mount.point, TRANSIENT_ROOTS) or mount.fstype == "tmpfs":
        return not _holds_any(mount.point, needed)
    return False


def mounts_to_detach(mounts: Iterable[HostMount], needed: Iterable[str]) -> list[str]:
    """The mount points a sandbox detaches, children before their parents (reverse table
    order), the root never."""
    needed = list(needed)
    return [m.point for m in reversed(list(mounts)) if m.point != "/" and hides(m, needed)]


def hidden_mounts(mounts: Iterable[HostMount]) -> list[HostMount]:
    """Host mounts every sandbox hides, other than the private roots themselves (which it
    replaces), snapctl's own, what is under a built root (rebuilt, not missed) and tmpfs
    elsewhere (dropped unless the server needs one): what ``snapctl doctor`` reports."""
    return [
        m
        for m in mounts
        if m.point not in ("/", *PRIVATE_ROOTS)
        and not _within_any(m.point, BUILT_ROOTS)
        and not m.source.startswith(OWN_SOURCE_PREFIX)
        and (m.fstype in HIDDEN_TYPES or _within_any(m.point, TRANSIENT_ROOTS))
    ]


def _path_arguments(argv: Iterable[str]) -> list[str]:
    """Absolute paths among a command's arguments, plain or as ``--flag=PATH``."""
    found = []
    for arg in argv:
        value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        if value.startswith("/"):
            found.append(value)
    return found


def venv_root(program: str) -> str | None:
    """The virtual environment ``program`` runs in, resolved, if any: like Python finding its
    ``sys.prefix``, the program's directory or its parent holding ``pyvenv.cfg`` (the program
    itself is usually a symlink out of the venv, so only its directory is resolved)."""
    if not program.startswith("/"):
        return None
    directory = os.path.realpath(os.path.dirname(program))
    for candidate in (directory, os.path.dirname(directory)):
        if os.path.isfile(os.path.join(candidate, "pyvenv.cfg")):
            return candidate
    return None


def _named_paths(argv: list[str], cwd: str) -> list[str]:
    """The existing host paths a server names, as named (normalised, not resolved)."""
    named = [os.path.realpath(cwd)]
    named += [os.path.normpath(p) for p in _path_arguments(argv) if os.path.exists(p)]
    return named


def server_paths(argv: list[str], cwd: str) -> list[str]:
    """The existing host paths a server names (working directory, program, absolute path
    arguments), as named and resolved, and the virtual environment its program runs in: the
    mounts holding them stay, or are bound in."""
    paths = set()
    for path in _named_paths(argv, cwd):
        paths.update({path, os.path.realpath(path)})
    venv = venv_root(argv[0]) if argv else None
    if venv is not None:
        paths.add(venv)
    return sorted(paths)


def _bindable(path: str) -> bool:
    return _within_any(path, BINDABLE_ROOTS) and path not in PRIVATE_ROOTS


def host_binds(argv: list[str], cwd: str) -> list[str]:
    """The host paths to bind at the same place inside a sandbox: the resolved paths of
    :func:`server_paths` under a private root the sandbox may bind into, outermost only.

    Only resolved paths are bound (and bound refusing any symlink on them,
    ``BindMount.no_symlinks``): a symlink under ``/tmp``, where any user may plant one, never
    chooses what the sandbox shows at a path. A path the server names there that reaches its
    place through a symlink outside every bind is refused: the sandbox's ``/tmp`` would not
    have that link, so the server would find nothing there (or, bound through the link, what
    whoever planted it chose).

    Raises :class:`PrivatePathError` for that, and if the working directory is a private root
    itself (the server would see an empty tmpfs there); a path argument that is one is left
    private.
    """
    resolved_cwd = os.path.realpath(cwd)
    if resolved_cwd in PRIVATE_ROOTS:
        raise PrivatePathError(
            f"the server's working directory {resolved_cwd} is private to each sandbox (a "
            "fresh tmpfs); run it from another directory"
        )
    resolved = {os.path.realpath(path) for path in server_paths(argv, cwd)}
    binds: list[str] = []
    for path in sorted(p for p in resolved if _bindable(p)):  # a parent before what it holds
        if not any(is_within(path, outer) for outer in binds):
            binds.append(path)
    for path in _named_paths(argv, cwd):
        real = os.path.realpath(path)
        if real != path and _bindable(path) and not any(is_within(path, b) for b in binds):
            raise PrivatePathError(
                f"the server names {path}, which reaches {real} through a symlink under "
                "/tmp: each sandbox has a private /tmp without that link, and binding "
                "through a link there would let whoever planted it choose what the server "
                f"reads; name {real} instead"
            )
    return binds
