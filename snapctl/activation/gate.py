"""The identity gate: record what a capture depends on outside its image, and refuse a copy
on a host that differs (before CRIU runs), unless the named fields are waived."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from snapctl.activation.environment import restorer_environment
from snapctl.activation.launch import LaunchOptions, redact_argv, snapshot_config_arg
from snapctl.images.identity.compare import IdentityMismatchError, require_match
from snapctl.images.identity.host import current_identity
from snapctl.images.identity.models import Difference, Identity
from snapctl.images.identity.tree import FileView, tree_files
from snapctl.images.manifest import Manifest
from snapctl.statedir import StateDir


def file_hash_cache(state: StateDir) -> Path:
    """Where hashes of files outside images are cached (by path and stat)."""
    return state.verified / "files"


def capture_identity(
    pids: Iterable[int],
    *,
    criu_version: str,
    server_argv: list[str],
    server_env: Mapping[str, str],
    state: StateDir,
) -> Identity:
    """The identity of a tree about to be dumped (its mapped and open files hashed now)."""
    return current_identity(
        criu_version=criu_version,
        argv=redact_argv(server_argv),
        env=server_env,
        files=tree_files(pids),
        cache_dir=file_hash_cache(state),
    )


def expected_argv(options: LaunchOptions) -> list[str] | None:
    """The argv a capture of ``options.server_argv`` records (None: no command given)."""
    if not options.server_argv:
        return None
    config = snapshot_config_arg(options.server_timeout_s)
    return redact_argv([*options.server_argv, "--snapshot-config", config])


def check_identity(
    manifest: Manifest,
    image: Path,
    *,
    criu_version: str,
    options: LaunchOptions,
    state: StateDir,
    env: Mapping[str, str] | None = None,
    view: FileView | None = None,
) -> list[Difference]:
    """Compare this host with the image's identity; raise :class:`IdentityMismatchError`
    listing what differs and is not waived by ``options.allow_mismatch``; return the
    differences waived or only noted.

    Without a server command the copy does not claim to stand for one, so argv is taken as
    recorded; with one it must match the captured argv (secrets redacted on both sides).
    ``view``: the files are compared where the copy will read them (a container's).
    """
    recorded = manifest.identity
    current = None
    if recorded is not None:
        current = current_identity(
            criu_version=criu_version,
            argv=expected_argv(options) or recorded.argv,
            # What a capture here would have given its server, not all of this environment.
            env=restorer_environment(os.environ if env is None else env, recorded.env),
            files=[record.path for record in recorded.files],
            cache_dir=file_hash_cache(state),
            env_salt=recorded.env_salt,
            view=view,
        )
    shown = require_match(recorded, current, allow=options.allow_mismatch, path=image)
    if recorded is None and manifest.criu_version != criu_version:
        # Without an identity (schema 1, waived) the manifest still names the CRIU that
        # dumped it; a recorded identity compares it with the other fields.
        differs = Difference(
            field="criu_version",
            detail=f"image {manifest.criu_version}, here {criu_version}",
            waivable=True,
        )
        if differs.field not in options.allow_mismatch:
            raise IdentityMismatchError([differs], path=image)
        shown.append(differs)
    return shown
