"""The control directory: its safety checks and typed access to its six files.

Every read and write through :class:`ControlDir` re-checks the directory first (absolute path
without ``..``, no symlinked component, owned by the effective UID with no group/other bits,
every ancestor owned by root or that UID and not writable by others unless it is a root-owned
sticky directory such as /tmp), because the protocol requires the checks on every access, not
only at start. Nothing outside :mod:`snapctl.protocol` touches the directory.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Literal, cast, overload

from snapctl.errors import ControlDirError
from snapctl.protocol.atomic import read_json_bounded, validate_model, write_json_atomic
from snapctl.protocol.models import (
    CONTROL_MODELS,
    Activation,
    CaptureReady,
    Challenge,
    ControlFile,
    ErrorReport,
    Release,
    Status,
)

ControlModel = CaptureReady | Activation | Challenge | Release | Status | ErrorReport

# The only files a later write may replace; the rest are create-once.
OVERWRITABLE = frozenset({ControlFile.STATUS, ControlFile.ERROR})

# Exact types: Release subclasses Challenge but is a different file.
_FILE_OF_MODEL: dict[type[ControlModel], ControlFile] = {
    CaptureReady: ControlFile.CAPTURE_READY,
    Activation: ControlFile.ACTIVATION,
    Challenge: ControlFile.CHALLENGE,
    Release: ControlFile.RELEASE,
    Status: ControlFile.STATUS,
    ErrorReport: ControlFile.ERROR,
}

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_GROUP_OTHER_BITS = 0o077


class ControlDir:
    """One control directory. Cheap to construct; checks happen on each access."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        # Keep the caller's spelling: Path() would silently drop some of what we must reject.
        self._raw = os.fspath(path)
        self.path = Path(self._raw)

    def __repr__(self) -> str:
        return f"ControlDir({self._raw!r})"

    def validate(self, *, require_empty: bool = False) -> None:
        """Raise ControlDirError unless the directory is safe (and empty, if required)."""
        self._check_syntax()
        chain = _component_chain(self.path)
        for ancestor in chain[:-1]:
            _check_ancestor(ancestor)
        _check_self(chain[-1])
        if require_empty:
            try:
                entries = sorted(os.listdir(self.path))
            except OSError as error:
                raise ControlDirError(
                    f"cannot list control directory: {error.strerror}", path=self.path
                ) from error
            if entries:
                shown = ", ".join(entries[:6]) + (", ..." if len(entries) > 6 else "")
                raise ControlDirError(
                    f"control directory must be empty, found {len(entries)} entries: {shown}",
                    path=self.path,
                )

    def _check_syntax(self) -> None:
        if not os.path.isabs(self._raw):
            raise ControlDirError("control directory must be an absolute path", path=self.path)
        if ".." in self._raw.split("/"):
            raise ControlDirError("control directory must not contain '..'", path=self.path)

    def file_path(self, name: ControlFile) -> Path:
        """Where ``name`` lives; only the six protocol names are accepted."""
        return self.path / ControlFile(name).value

    def exists(self, name: ControlFile) -> bool:
        """Whether anything (even a dangling symlink) occupies ``name``."""
        self.validate()
        return os.path.lexists(self.file_path(name))

    def present(self) -> tuple[ControlFile, ...]:
        """The control files that exist now, in protocol order."""
        self.validate()
        return tuple(name for name in ControlFile if os.path.lexists(self.file_path(name)))

    def read_raw(self, name: ControlFile) -> dict[str, Any] | None:
        """The JSON object in ``name`` unvalidated, or None if it does not exist yet."""
        self.validate()
        return read_json_bounded(self.file_path(name))

    @overload
    def read(self, name: Literal[ControlFile.CAPTURE_READY]) -> CaptureReady | None: ...
    @overload
    def read(self, name: Literal[ControlFile.ACTIVATION]) -> Activation | None: ...
    @overload
    def read(self, name: Literal[ControlFile.CHALLENGE]) -> Challenge | None: ...
    @overload
    def read(self, name: Literal[ControlFile.RELEASE]) -> Release | None: ...
    @overload
    def read(self, name: Literal[ControlFile.STATUS]) -> Status | None: ...
    @overload
    def read(self, name: Literal[ControlFile.ERROR]) -> ErrorReport | None: ...
    @overload
    def read(self, name: ControlFile) -> ControlModel | None: ...

    def read(self, name: ControlFile) -> ControlModel | None:
        """The strictly validated model in ``name``, or None if it does not exist yet."""
        payload = self.read_raw(name)
        if payload is None:
            return None
        model = validate_model(self.file_path(name), payload, CONTROL_MODELS[ControlFile(name)])
        return cast(ControlModel, model)

    def write(self, model: ControlModel, *, overwrite: bool = False) -> Path:
        """Atomically publish ``model`` under its file name; only status and error overwrite."""
        name = _FILE_OF_MODEL.get(type(model))
        if name is None:
            raise TypeError(f"not a control file model: {type(model).__name__}")
        if overwrite and name not in OVERWRITABLE:
            raise ValueError(f"{name.value} is create-once and may not be overwritten")
        self.validate()
        target = self.file_path(name)
        write_json_atomic(target, model, overwrite=overwrite)
        return target


def create_control_dir(path: str | os.PathLike[str]) -> ControlDir:
    """Make a fresh 0700 control directory (or adopt an existing empty one) for the server."""
    control = ControlDir(path)
    control._check_syntax()
    for ancestor in _component_chain(control.path)[:-1]:
        _check_ancestor(ancestor)
    try:
        os.mkdir(control.path, 0o700)
    except FileExistsError:
        pass  # Adopted only if validate() below finds it safe and empty.
    except OSError as error:
        raise ControlDirError(
            f"cannot create control directory: {error.strerror}", path=control.path
        ) from error
    else:
        # mkdir's mode is filtered by the umask; make the owner bits exact.
        os.chmod(control.path, 0o700)
    control.validate(require_empty=True)
    return control


def _component_chain(path: Path) -> list[Path]:
    """``/a/b/c`` -> ``[/, /a, /a/b, /a/b/c]``."""
    parts = path.parts
    return [Path(*parts[: index + 1]) for index in range(len(parts))]


def _lstat(path: Path) -> os.stat_result:
    try:
        return os.lstat(path)
    except FileNotFoundError as error:
        raise ControlDirError(f"{path} does not exist", path=path) from error
    except OSError as error:
        raise ControlDirError(f"cannot stat {path}: {error.strerror}", path=path) from error


def _check_ancestor(path: Path) -> None:
    info = _lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise ControlDirError(f"control directory path has a symlink component: {path}", path=path)
    if not stat.S_ISDIR(info.st_mode):
        raise ControlDirError(f"control directory ancestor is not a directory: {path}", path=path)
    if info.st_uid not in (0, os.geteuid()):
        raise ControlDirError(
            f"control directory ancestor has an untrusted owner (uid {info.st_uid}): {path}",
            path=path,
        )
    root_sticky = info.st_uid == 0 and bool(info.st_mode & stat.S_ISVTX)
    if info.st_mode & _WRITABLE_BY_OTHERS and not root_sticky:
        raise ControlDirError(
            f"control directory ancestor is group- or world-writable: {path}", path=path
        )


def _check_self(path: Path) -> None:
    info = _lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise ControlDirError(f"control directory is a symlink: {path}", path=path)
    if not stat.S_ISDIR(info.st_mode):
        raise ControlDirError(f"control directory is not a directory: {path}", path=path)
    euid = os.geteuid()
    if info.st_uid != euid:
        raise ControlDirError(
            f"control directory is owned by uid {info.st_uid}, not the effective uid {euid}",
            path=path,
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & _GROUP_OTHER_BITS:
        raise ControlDirError(
            f"control directory mode {mode:04o} grants group or other access (need 0700)",
            path=path,
        )
