"""Where snapctl keeps its host state: the state directory's layout (activations, kept logs,
records for ps/stop, caches, models, claims) and the record files in it."""

from __future__ import annotations

import os
from pathlib import Path

from snapctl.errors import SnapctlError
from snapctl.protocol.atomic import write_json_atomic
from snapctl.statedir.names import (
    NameReservation,
    ReservationHolder,
    check_name,
    check_name_free,
    read_holder,
    reserve_name,
)
from snapctl.statedir.records import ActivationRecord

DEFAULT_STATE_DIR = Path("/var/lib/snapctl")


class UnknownActivationError(SnapctlError):
    """No record has the name or activation id asked for (nor, for a log, a kept log)."""


class NoServerLogError(SnapctlError):
    """The activation is recorded, but its server has not written a log yet."""


def state_dir() -> Path:
    return Path(os.environ.get("SNAPCTL_STATE_DIR", DEFAULT_STATE_DIR)).absolute()


class StateDir:
    """The paths under one state directory (``SNAPCTL_STATE_DIR``, else /var/lib/snapctl) and
    the activation records in it."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or state_dir()

    @property
    def activations(self) -> Path:
        return self.root / "activations"

    @property
    def cgroup_prefix(self) -> str:
        """What this state directory's activations' cgroup names start with (a digest of its
        path), so that its ``gc`` sweeps only its own activations' cgroups."""
        import hashlib

        return hashlib.sha256(os.fsencode(self.root.absolute())).hexdigest()[:8] + "-"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def records(self) -> Path:
        return self.root / "records"

    @property
    def verified(self) -> Path:
        return self.root / "verified"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def views(self) -> Path:
        """Pagemaps as lazy copies see them, by content (see ``snapctl.criu.lazy.pagemap``)."""
        return self.root / "views"

    @property
    def claims(self) -> Path:
        """Claims on staging directories beside images (see ``snapctl.supervision.leftovers``)."""
        return self.root / "claims"

    @property
    def criu(self) -> Path:
        """CRIU's kernel probe cache where /run is not a tmpfs (see ``snapctl.criu.kdat``)."""
        return self.root / "criu"

    def ensure(self) -> None:
        for path in (self.activations, self.logs, self.records, self.verified, self.models):
            path.mkdir(parents=True, mode=0o700, exist_ok=True)

    def record_path(self, name: str) -> Path:
        # Checked here too, not only where the name comes in: a path is never built from one
        # that could leave the records directory.
        return self.records / f"{check_name(name)}.json"

    def reserve_name(self, name: str) -> NameReservation:
        """Reserve ``name`` until the activation stops (see ``snapctl.statedir.names``)."""
        return reserve_name(self.records, name)

    def check_name_free(self, name: str) -> None:
        """Refuse ``name`` as :meth:`reserve_name` would, reserving nothing."""
        check_name_free(self.records, name)

    def name_holder(self, name: str) -> ReservationHolder | None:
        """The process that reserved ``name``, as it wrote itself down (it may be gone)."""
        return read_holder(self.records, name)

    def save_record(self, record: ActivationRecord) -> None:
        payload = record.model_dump(mode="json")
        write_json_atomic(self.record_path(record.name), payload, overwrite=True)

    def load_records(self) -> list[ActivationRecord]:
        if not self.records.is_dir():
            return []
        return [
            ActivationRecord.model_validate_json(path.read_text())
            for path in sorted(self.records.glob("*.json"))
        ]

    def find_record(self, name: str) -> ActivationRecord:
        """The activation ``name`` names: the record of that name, else the one with that
        activation id (a name may be another activation's id: the name wins)."""
        records = self.load_records()
        for record in records:
            if record.name == name:
                return record
        for record in records:
            if record.activation_id == name:
                return record
        raise UnknownActivationError(f"no activation named {name!r} (see snapctl ps)")

    def server_log(self, name: str) -> tuple[Path, Path | None]:
        """The server log of the activation ``name`` names (see :meth:`find_record`), and its
        record's path while it runs; or, by activation id, a stopped one's kept log (None)."""
        try:
            record = self.find_record(name)
        except UnknownActivationError:
            log = self.logs / name / "server.log"
            if "/" not in name and name not in (".", "..") and log.exists():
                return log, None
            raise
        log = Path(record.logs_dir) / "server.log"
        if not log.exists():
            raise NoServerLogError(f"{name} has no server log yet", path=log)
        return log, self.record_path(record.name)

    def drop_record(self, name: str) -> None:
        self.record_path(name).unlink(missing_ok=True)
