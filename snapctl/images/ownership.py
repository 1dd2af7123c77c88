"""Who may change an image: only those who may already run code as root.

A copy restores an image's process tree as root, so whoever can change the image's files, or
rename a directory on its path, runs code as root. Before a copy starts (in-process, through
the agent, in a copy's supervisor) and before ``pool set`` keeps copies of an image,
:func:`check_image_owner` refuses an image unless every directory from ``/`` down to it, each
symlink followed on the way, and everything in it outside ``shm/`` is owned by a trusted user
and writable by no one else.

The trusted users are root and, when snapctl itself does not run as root (tests, a user's own
images), the user it runs as: that user could change the image anyway.

The rule, per entry (``lstat``, symlinks resolved one component at a time, as the kernel does):

- every directory on the path, every symlink on it and the image directory itself must be
  owned by a trusted user;
- none may be writable by its group or by others, with one exception: a directory above the
  image that has the sticky bit (``/tmp``, mode 1777). There only an entry's owner (or the
  directory's, or root) may rename or remove it, and the next component of the path must
  itself be a trusted user's, so no one else can put another directory in its place. The
  image directory itself gets no such exception (anyone could add entries to it);
- inside the image, every directory and file except the saved ``/dev/shm`` (``shm/``) must be
  a trusted user's and writable by no one else; ``shm/`` itself as a directory above the
  image (it is a copy of ``/dev/shm``, mode 1777). What ``shm/`` holds keeps the server's own
  owners and modes, which the restore gives back to the same server; like every file of the
  image it is hashed against the manifest on every copy (any write since changes its stat
  key, and the next copy hashes it again).

A refusal is an :class:`~snapctl.images.store.ImageError` (exit 5) naming the path and the
command that fixes it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from snapctl.images.store import ImageError

SHM = "shm"
MAX_LINKS = 40  # as the kernel's ELOOP


def arriving_mode(name: str, mode: int, *, directory: bool) -> int:
    """The mode an entry of a pulled or imported image (``name``, relative to it) gets from
    the ``mode`` it arrived with: owned by whoever pulls or imports, another host's setuid and
    setgid bits mean nothing here and would hand their privileges to whoever has its ids.
    What ``shm/`` holds keeps the server's rwx bits (and a directory its sticky bit: a saved
    ``/dev/shm`` is mode 1777 and safe only with it), as the rule above leaves them; anything
    else loses its group's and others' write bits, so that an image that arrives is one
    :func:`check_image_owner` accepts, not one ``inspect`` shows and ``copy`` refuses."""
    if name == SHM or name.startswith(SHM + "/"):
        return mode & (0o1777 if directory else 0o777)
    return mode & 0o755


def trusted_uids() -> frozenset[int]:
    """root, and the user snapctl runs as."""
    return frozenset({0, os.geteuid()})


def check_image_owner(image: Path) -> None:
    """Refuse ``image`` (an existing directory) unless only trusted users can change it, its
    contents outside ``shm/`` or any directory or symlink on its path (module docstring)."""
    checker = _Checker(image.absolute(), trusted_uids())
    try:
        resolved = checker.walk()
        checker.check(resolved, os.lstat(resolved), final=True)
        checker.inside(resolved)
    except OSError as error:
        raise ImageError(f"cannot check who may change {checker.image}: "
                         f"{error.strerror or error}", path=error.filename) from error  # fmt: skip


class _Checker:
    def __init__(self, image: Path, trusted: frozenset[int]) -> None:
        self.image = image
        self.trusted = trusted

    def walk(self) -> str:
        """Resolve the image's path from ``/``, checking each entry met as a directory above
        the image; the resolved path."""
        current = "/"
        self.check(current, os.lstat(current), final=False)
        pending = list(self.image.parts[1:])
        links = 0
        while pending:
            name = pending.pop(0)
            if name in ("", "."):
                continue
            if name == "..":
                current = os.path.dirname(current)  # already checked on the way down
                continue
            path = os.path.join(current, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_LINKS:
                    raise ImageError(f"{self.image}: too many symbolic links on its path",
                                     path=self.image)  # fmt: skip
                self.owner(path, st, "replace it with one root owns")
                target = os.readlink(path)
                if target.startswith("/"):
                    current = "/"
                pending = [*Path(target).parts[1 if target.startswith("/") else 0 :], *pending]
                continue
            self.check(path, st, final=False)
            current = path
        return current

    def inside(self, root: str) -> None:
        """Every directory and file of the image but what ``shm/`` holds. Anything else (a
        symlink, a device) is left to the verification every copy makes, which refuses it."""
        for directory, dirnames, filenames in os.walk(root):
            for name in sorted(dirnames) + sorted(filenames):
                path = os.path.join(directory, name)
                st = os.lstat(path)
                if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
                    self.check(path, st, final=not (directory == root and name == SHM))
            if directory == root and SHM in dirnames:
                dirnames.remove(SHM)

    def check(self, path: str, st: os.stat_result, *, final: bool) -> None:
        """``path`` (``final``: the image or what it holds; else a directory above it)."""
        what = _kind(st.st_mode)
        self.owner(path, st, f"chown root {path}")
        mode = stat.S_IMODE(st.st_mode)
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            if not final and stat.S_ISDIR(st.st_mode) and mode & stat.S_ISVTX:
                return  # sticky: the next component, a trusted user's, cannot be replaced
            writers = "its group and others" if mode & stat.S_IWGRP and mode & stat.S_IWOTH \
                else "its group" if mode & stat.S_IWGRP else "others"  # fmt: skip
            self.refuse(path, f"{what} writable by {writers} (mode {mode:04o})",
                        f"chmod go-w {path}")  # fmt: skip

    def owner(self, path: str, st: os.stat_result, fix: str) -> None:
        if st.st_uid not in self.trusted:
            whom = "root" if self.trusted == {0} else f"root or uid {os.geteuid()}"
            self.refuse(path, f"{_kind(st.st_mode)} owned by uid {st.st_uid}, not {whom}", fix)

    def refuse(self, path: str, problem: str, fix: str) -> None:
        raise ImageError(
            f"{self.image}: {path} is {problem}; an image is code that copies restore as "
            "root, so only root may be able to change it or any directory above it "
            f"(fix: {fix})",
            path=path,
        )


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a symbolic link" if stat.S_ISLNK(mode) else "a file"
