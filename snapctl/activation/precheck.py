"""What a copy's start refuses before anything starts, and whether it restores lazily by
default: the one place ``snapctl copy`` in-process, the agent (per request, before it takes a
parked copy) and a copy's supervisor ask, so that all three refuse in the same order with the
same messages.

Light at import (errors only): the checks import what they use when they run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snapctl.errors import ExitStatus, SnapctlError

if TYPE_CHECKING:
    from snapctl.statedir import StateDir

# A note for the user (shown on stderr in-process, streamed by the agent).
Note = Callable[[str], None]

PUBLISH_OPTION = "--publish"
WAIVER_OPTION = "'--allow-mismatch'"
NUMBERED_NAME_OPTION = "'--name' with '--count'"


class CopyUsageError(SnapctlError):
    """A copy refused before anything starts for an option's value: ``option`` names the
    option to blame as click's usage errors do ("" for the command line as a whole)."""

    exit_status = ExitStatus.USAGE

    def __init__(self, message: str, *, option: str, **fields: Any) -> None:
        super().__init__(message, **fields)
        self.option = option


def check_copy_start(
    *,
    image: str,
    allow_mismatch: Sequence[str],
    name: str | None,
    count: int,
    publish: tuple[str, int] | None,
    expose: bool,
    state: StateDir | None,
    note: Note,
    into_container: str | None = None,
    check_owner: bool = True,
) -> Path | None:
    """Refuse, in this order: an unknown or unwaivable ``--allow-mismatch`` name, a ``--name``
    that cannot be numbered ``--count`` times, a name in use, an ``into_container`` with a
    ``--count`` over 1 or that cannot host the copy
    (:func:`~snapctl.activation.container.resolve_container`), a ``--publish`` that cannot be
    bound (on the container's network with ``into_container``; or ``--expose`` without it),
    an ``image`` that is no image directory, or one that
    someone other than root can change (:func:`~snapctl.registry.source.require_image`); then
    note each waiver that waives nothing.

    ``state`` None: names are checked but not looked up (where the start's own reservation
    is the next step anyway); ``check_owner`` False: the image's owners are not checked
    again (a supervisor's recheck of what its agent checked). Returns the image directory,
    or None when ``image`` is a registry reference (the caller pulls it). Usage errors are
    :class:`CopyUsageError`; the others are raised as the step that would meet them later
    raises them (``NameInUseError``, ``PortInUseError``, ...).
    """
    from snapctl.images.identity.compare import check_waivers, needless_waivers

    try:
        check_waivers(allow_mismatch)
    except SnapctlError as error:
        raise CopyUsageError(error.message, option=WAIVER_OPTION) from error
    _check_names(name, count, state)
    inside = None
    if into_container is not None:
        from snapctl.activation.container import resolve_container

        if count > 1:
            raise CopyUsageError(
                f"--count {count} with --into-container: a container hosts one copy (copies "
                "there would share its network); restore each into a container of its own",
                option="'--count' with '--into-container'",
            )

        inside = resolve_container(into_container).pid
    check_publish_target(publish, expose, count, inside=inside)
    published = _published_image(image, check_owner)
    for waiver in needless_waivers(allow_mismatch):
        note(f"--allow-mismatch {waiver} is not needed: {waiver} never refuses a copy")
    return published


def _check_names(name: str | None, count: int, state: StateDir | None) -> None:
    """Each name the copies would take is valid and free now (refused after a parked copy
    was taken for it, it would cost the pool that copy); the start reserves them for real."""
    if name is None:
        return
    from snapctl.statedir.names import InvalidNameError, check_name, numbered_names

    try:
        names = numbered_names(name, count) if count > 1 else [check_name(name)]
    except InvalidNameError as error:
        if count > 1:
            raise CopyUsageError(error.message, option=NUMBERED_NAME_OPTION) from error
        raise CopyUsageError(error.message, option="'--name'") from error
    if state is None:
        return
    for each in names:
        state.check_name_free(each)  # NameInUseError, as the start would raise


def check_publish_target(
    publish: tuple[str, int] | None, expose: bool, count: int, *, inside: int | None = None
) -> None:
    """Refuse ``--publish``: an address not loopback without ``--expose`` or not on this
    host, or a port in use (each of ``count`` ports counting up); ``--expose`` without it.
    ``inside``: on the network of that process (a container's first one), not the host's."""
    if publish is None:
        if expose:
            raise CopyUsageError(
                "--expose only widens --publish; give --publish ADDR:PORT", option=""
            )
        return
    from snapctl.namespaces.publish import check_publish

    address, port = publish
    if port and port + count - 1 > 65535:
        raise CopyUsageError(
            f"{count} copies from port {port} need ports up to {port + count - 1}, past 65535; "
            "give a lower first port",
            option=PUBLISH_OPTION,
        )
    ports = [port + index for index in range(count)] if port else []
    if inside is None:
        check_publish(address, ports, exposed=expose)
        return
    from snapctl.namespaces.netns import NetnsConnector

    with NetnsConnector(inside) as there:
        there.call(lambda: check_publish(address, ports, exposed=expose))


def _published_image(image: str, check_owner: bool) -> Path | None:
    from snapctl.registry.source import is_reference, require_image

    if is_reference(image):
        return None
    return require_image(image, restore=check_owner).absolute()


def decide_lazy(requested: bool | None, image: Path, note: Note | None = None) -> bool:
    """Whether a copy of ``image`` restores lazily: ``requested`` (``--lazy/--no-lazy``) when
    given, else when the image holds :data:`~snapctl.criu.lazy.tuning.LAZY_DEFAULT_MIN_BYTES`
    of pages or more, said in a ``note``. Every entry decides it here (the CLI in-process, the
    agent per request, a copy's supervisor, the pool's refill)."""
    if requested is not None:
        return requested
    from snapctl.criu.lazy.pagemap import PAGE_SIZE
    from snapctl.criu.lazy.tuning import LAZY_DEFAULT_MIN_BYTES
    from snapctl.images import load_manifest

    manifest = load_manifest(image.absolute())
    lazy = manifest.dump_stats.pages_written * PAGE_SIZE >= LAZY_DEFAULT_MIN_BYTES
    if lazy and note is not None:
        note(f"restoring lazily: the image holds {LAZY_DEFAULT_MIN_BYTES >> 20} MiB of pages or "
             "more (--no-lazy: restore every page first)")  # fmt: skip
    return lazy


def lazy_help() -> str:
    """``--lazy/--no-lazy``'s help, its default's threshold read from the tuning constant."""
    from snapctl.criu.lazy.tuning import LAZY_DEFAULT_MIN_BYTES

    return (
        "Serve at once and let memory arrive on demand and in the background (CRIU lazy "
        "pages); the image stays held until every page is in (see ps). Default: lazy when the "
        f"image holds at least {LAZY_DEFAULT_MIN_BYTES >> 20} MiB of pages."
    )
