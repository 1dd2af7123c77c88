"""Where ``copy --image`` and ``inspect`` find an image: a directory, or a registry reference
pulled into (or read from) the local image cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from snapctl.images.catalog import ImageSummary, list_images, summarize
from snapctl.images.store import ImageError
from snapctl.registry.cache import blob_cache, pulled_root, read_record
from snapctl.registry.client import Reference, RegistryClient
from snapctl.registry.pull import DEFAULT_JOBS, PullReport, Remote, describe, pull_cached
from snapctl.registry.workingsets import AttachedSets, attached
from snapctl.statedir import StateDir

if TYPE_CHECKING:
    from snapctl.trust.policy import Policy


def is_reference(text: str) -> bool:
    """True when ``text`` is no existing path and reads as ``REGISTRY/REPOSITORY[...]``: the
    first component names a host (has a dot or a port, or is localhost)."""
    if Path(text).exists() or text.startswith(("/", ".", "~")) or "/" not in text:
        return False
    host = text.split("/", 1)[0]
    return "." in host or ":" in host or host == "localhost"


def require_image(text: str, *, restore: bool = True) -> Path:
    """A local image directory, or an error naming both readings of ``text``. With
    ``restore`` (a copy or the pool will restore it as root: every caller but ``inspect``),
    only one that no one but root, or the user snapctl runs as, can change
    (:func:`~snapctl.images.ownership.check_image_owner`)."""
    path = Path(text)
    if path.is_dir():
        if restore:
            from snapctl.images.ownership import check_image_owner

            check_image_owner(path)
        return path
    raise ImageError(
        f"{text} is neither an image directory nor a registry reference "
        "(REGISTRY/REPOSITORY[:TAG][@DIGEST])",
        path=path,
    )


def pull_for_copy(
    reference: str,
    state: StateDir,
    *,
    plain_http: bool,
    policy: Policy | None = None,
    jobs: int = DEFAULT_JOBS,
    progress: Callable[[int], None] | None = None,
    total: Callable[[int], None] | None = None,
) -> PullReport:
    """Pull ``reference`` into the local image cache (or find it there, pulled and verified),
    once the trust ``policy`` accepts it (None: the system's, see
    :func:`~snapctl.trust.policy.load_policy`); a pulled image is checked as a local one is
    (:func:`require_image`) before it is used."""
    from snapctl.trust.policy import load_policy

    policy = policy or load_policy(None)
    state.ensure()
    client = RegistryClient(Reference.parse(reference), plain_http=plain_http)
    try:
        report = pull_cached(client, state, policy=policy, jobs=jobs, progress=progress,
                             total=total)  # fmt: skip
    finally:
        client.close()
    require_image(report.image)
    return report


def describe_remote(
    reference: str, state: StateDir, *, plain_http: bool
) -> tuple[Remote, AttachedSets]:
    """The manifest, config and manifest.json of ``reference``, and the working sets attached
    to it (their list only): no page data is fetched."""
    client = RegistryClient(Reference.parse(reference), plain_http=plain_http)
    try:
        remote = describe(client, blob_cache(state))
        return remote, attached(client, remote.manifest_digest)
    finally:
        client.close()


def list_pulled(state: StateDir) -> list[ImageSummary]:
    """The images in the local image cache, each with the references it was pulled by."""
    root = pulled_root(state)
    if not root.is_dir():
        return []
    rows = []
    for image in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        record = read_record(image)
        row = summarize(image, state.verified)
        references = ", ".join(record.references) if record else None
        rows.append(row.model_copy(update={"reference": references}))
    return rows


def image_records(
    root: Path | None, state: StateDir, default_root: Path
) -> list[dict[str, object]]:
    """``images --json``'s rows: the images in ``root`` (default: ``default_root``), and
    without ``root`` the ones pulled into ``state`` (the agent answers ``GET /v1/images``
    with the same, for its own state directory)."""
    rows = list_images(root.absolute() if root else default_root, state.verified)
    if root is None:
        rows += list_pulled(state)
    return [row.model_dump(mode="json") for row in rows]
