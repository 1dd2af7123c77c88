"""The pool's targets as the state directory keeps them (``STATE/pool/targets.json``), so that
a new agent refills them. Runs in the agent."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from snapctl.errors import SnapctlError
from snapctl.pool.models import PoolTarget, PoolTargets
from snapctl.pool.records import pool_dir
from snapctl.protocol.atomic import read_json_bounded, write_json_atomic
from snapctl.statedir import StateDir

TARGETS_NAME = "targets.json"


class PoolTargetsError(SnapctlError):
    """``STATE/pool/targets.json`` cannot be read: the pool refuses to start rather than
    start with no targets and overwrite the file at the next ``pool set``."""


def targets_path(state: StateDir) -> Path:
    return pool_dir(state) / TARGETS_NAME


def load_targets(state: StateDir) -> list[PoolTarget]:
    """The targets kept by the last agent (none if it kept none); a file that cannot be read
    is refused, naming it, rather than lost (the next save would replace it)."""
    path = targets_path(state)
    try:
        data = read_json_bounded(path)
        if data is None:
            return []
        return list(PoolTargets.model_validate_json(json.dumps(data)).targets)
    except SnapctlError as error:
        why = error.message
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "file"
        why = f"{where}: {first['msg']}"
    raise PoolTargetsError(
        f"the pool targets in {path} cannot be read ({why}): repair the file, or move it "
        "aside to start with no pool targets (snapctl pool set adds them again)",
        path=path,
    )


def save_targets(state: StateDir, targets: list[PoolTarget]) -> None:
    pool_dir(state).mkdir(parents=True, mode=0o700, exist_ok=True)
    write_json_atomic(targets_path(state), PoolTargets(targets=tuple(targets)), overwrite=True)
