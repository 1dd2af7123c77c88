"""Whether a pool target's image can still vouch for its parked copies: still published,
still the one they were restored from, and (every so often) still verified. Runs in the
agent (the refill tick)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from snapctl.images import ImageError
from snapctl.pool.identity import published_identity
from snapctl.pool.models import DiscardReason, ParkedRecord

VERIFY_EVERY_S = 5.0


@dataclass
class ImageWatch:
    """What the pool last saw of one target's image: its identity (None: not published),
    the manifest's stat it was read against, and when its files were last verified."""

    identity: tuple[str, str] | None = None
    manifest_stat: tuple[int, int, int] | None = None
    verified_at: float = 0.0
    last_failure: str | None = None  # the verification's, when it failed

    def check(self, image: Path, now: float, verified_dir: Path) -> tuple[DiscardReason | None,
                                                                          bool]:  # fmt: skip
        """Look at the image now: why none of its parked copies may stay (``removed``,
        ``verification``; None: they may, each still compared with :meth:`vouches_for`),
        and whether the manifest changed since the last look."""
        from snapctl.images import load_manifest, verify_image
        from snapctl.images.store import is_verified

        try:
            st = (image / "manifest.json").stat()
            stat_key: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            stat_key = None
        changed = stat_key is None or stat_key != self.manifest_stat
        if changed:
            self.manifest_stat = stat_key
            self.identity = None if stat_key is None else published_identity(image)
        if self.identity is None:
            return "removed", changed
        if now - self.verified_at < VERIFY_EVERY_S:
            return None, changed
        self.verified_at = now
        manifest = None
        with contextlib.suppress(ImageError, OSError):
            manifest = load_manifest(image)
        if manifest is not None and not is_verified(image, manifest, verified_dir):
            try:
                verify_image(image, cache_dir=verified_dir)
            except (ImageError, OSError) as error:
                self.last_failure = f"verification: {error}"
                return "verification", changed
        return None, changed

    def vouches_for(self, record: ParkedRecord) -> bool:
        """Whether the image now is the one ``record``'s copy was restored from."""
        return self.identity == (record.image_id, record.manifest_digest)
