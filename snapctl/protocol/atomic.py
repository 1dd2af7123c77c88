"""The one atomic JSON writer and the one bounded JSON reader for control and manifest files,
and the one replacing writer for caches and reports.

Writers never expose a partial file: content goes to ``<name>.tmp`` (created exclusively, never
through a symlink, mode 0600), is fsynced, renamed onto the name, and the directory is fsynced.
Readers accept only a regular file of at most 64 KiB holding one JSON object; "file not found"
is the only outcome that means "not yet" rather than an error. :func:`replace_file` renames
too, but does not fsync: what it writes may be lost in a crash, never seen torn.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from snapctl.errors import ProtocolError

MAX_JSON_BYTES = 65536
TMP_SUFFIX = ".tmp"

M = TypeVar("M", bound=BaseModel)


def encode_json(payload: BaseModel | Mapping[str, Any]) -> bytes:
    """Compact, key-sorted JSON: the byte form every snapctl file is written in."""
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else dict(payload)
    # NaN and infinities are not JSON; another reader would reject or misread them.
    text = json.dumps(data, separators=(",", ":"), sort_keys=True, allow_nan=False)
    return text.encode("utf-8")


def write_json_atomic(
    path: str | os.PathLike[str],
    payload: BaseModel | Mapping[str, Any],
    *,
    overwrite: bool = False,
    max_bytes: int = MAX_JSON_BYTES,
) -> None:
    """Publish ``payload`` at ``path`` in one step; refuse an existing target unless overwrite.

    ``max_bytes`` is raised only for files no protocol peer reads (an image's manifest).
    """
    target = Path(path)
    try:
        data = encode_json(payload)
    except (TypeError, ValueError) as error:
        raise ProtocolError(f"cannot encode {target.name} as JSON: {error}", path=target) from error
    if len(data) > max_bytes:
        raise ProtocolError(f"{target.name} would exceed {max_bytes} bytes", path=target)
    # Check-then-replace is not atomic against a concurrent writer of the same name; each
    # protocol file has exactly one writer, so this only guards against our own mistakes.
    if not overwrite and os.path.lexists(target):
        raise ProtocolError(f"refusing to overwrite existing {target.name}", path=target)
    tmp = target.with_name(target.name + TMP_SUFFIX)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except OSError as error:
        raise ProtocolError(f"cannot create {tmp.name}: {error.strerror}", path=tmp) from error
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, target)
        fsync_directory(target.parent)
    except BaseException as error:
        # Never leave a stale .tmp behind: the next O_EXCL create of this name would fail.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(error, OSError):
            raise ProtocolError(f"cannot write {target.name}: {error}", path=target) from error
        raise


def replace_file(path: Path, data: bytes, mode: int = 0o666) -> None:
    """Write ``data`` to ``path`` through a temporary of its own beside it and one rename: a
    reader (or a concurrent writer) sees the old file or a new one, never part of one. Not
    fsynced: for caches and reports. ``mode`` as for :func:`open` (the umask applies)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{TMP_SUFFIX}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with os.fdopen(os.open(tmp, flags, mode), "wb") as stream:
            stream.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def fsync_directory(directory: Path) -> None:
    """Make a directory's entries (a rename into it, say) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json_bounded(
    path: str | os.PathLike[str], *, max_bytes: int = MAX_JSON_BYTES
) -> dict[str, Any] | None:
    """Return the JSON object in ``path``, or None only when the file does not exist.

    ``max_bytes`` is raised only for files no protocol peer writes (a server's capture facts).
    """
    source = Path(path)
    try:
        before = os.lstat(source)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ProtocolError(f"cannot stat {source.name}: {error.strerror}", path=source) from error
    _require_regular(source, before)
    if before.st_size > max_bytes:
        raise ProtocolError(f"{source.name} is larger than {max_bytes} bytes", path=source)
    # O_NOFOLLOW and O_NONBLOCK: if the name was swapped for a symlink or a FIFO after lstat,
    # fail (or open without blocking) instead of following it or hanging on it.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(source, flags)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ProtocolError(f"cannot open {source.name}: {error.strerror}", path=source) from error
    try:
        # The name may have been replaced since lstat; judge what was actually opened.
        _require_regular(source, os.fstat(fd))
        data = _read_at_most(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ProtocolError(f"{source.name} is larger than {max_bytes} bytes", path=source)
    return _decode_object(source, data)


def _require_regular(path: Path, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = describe_mode(info.st_mode)
        raise ProtocolError(f"{path.name} must be a regular file, found a {kind}", path=path)


def describe_mode(mode: int) -> str:
    """What a file of this mode is, in a word or two ("symlink", "fifo"): for errors."""
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "special file"


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    remaining = limit
    while remaining > 0:
        chunk = os.read(fd, remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook`` for formats where a repeated key is malformed:
    ValueError naming the key."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            # Readers disagree on which duplicate wins; an ambiguous object is malformed.
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _decode_object(path: Path, data: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(
            data.decode("utf-8"),
            object_pairs_hook=reject_duplicate_keys,
            parse_constant=_reject_constant,
        )
    except (UnicodeDecodeError, ValueError) as error:
        # Files are replaced atomically, so a torn or empty file is a protocol violation.
        raise ProtocolError(f"{path.name} is not valid JSON: {error}", path=path) from error
    if not isinstance(payload, dict):
        found = type(payload).__name__
        raise ProtocolError(f"{path.name} must hold a JSON object, found {found}", path=path)
    return payload


def describe_validation_error(error: ValidationError) -> str:
    """Field locations and reasons only: input values may be secrets and are left out."""
    parts = []
    for item in error.errors(include_url=False, include_input=False):
        location = ".".join(str(part) for part in item["loc"]) or "(object)"
        parts.append(f"{location}: {item['msg']}")
    return "; ".join(parts)


def read_model(path: str | os.PathLike[str], model: type[M]) -> M | None:
    """Read ``path`` as ``model`` (strictly validated), or None when the file does not exist."""
    source = Path(path)
    payload = read_json_bounded(source)
    if payload is None:
        return None
    return validate_model(source, payload, model)


def validate_model(path: Path, payload: Mapping[str, Any], model: type[M]) -> M:
    """Validate an already read object; errors name the file and the failing fields."""
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        detail = describe_validation_error(error)
        raise ProtocolError(f"invalid {path.name}: {detail}", path=path) from error
