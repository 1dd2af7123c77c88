"""Published images: directory layout, the manifest, hashing, atomic publication, verification.

An image directory holds ``criu/`` (CRIU's images), ``shm/`` (the activation's ``/dev/shm`` as
it was while the tree was frozen, hard links kept), ``logs/`` and ``manifest.json``. The
manifest is written last inside a staging directory that is then renamed into place, so an
image either is complete and verifiable or does not exist under its name.

``identity`` records what a restore depends on outside the image and compares it with this
host; ``archive`` moves an image as one sealed ``.tar.zst``; ``catalog`` lists and removes
images; ``lock`` holds an image while it is read or replaced.
"""

from snapctl.images.manifest import FileEntry, Manifest, ProcessEntry
from snapctl.images.store import (
    ImageError,
    ImageExistsError,
    ImageStaging,
    ImageWriteError,
    hash_tree,
    load_manifest,
    stage_shm_copy,
    verify_image,
)

__all__ = [
    "FileEntry",
    "ImageError",
    "ImageExistsError",
    "ImageStaging",
    "ImageWriteError",
    "Manifest",
    "ProcessEntry",
    "hash_tree",
    "load_manifest",
    "stage_shm_copy",
    "verify_image",
]
