"""snapctl's state directory: activations, kept logs, records for ps/stop, caches, models."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from snapctl.protocol.atomic import write_json_atomic
from snapctl.supervision.names import NameReservation, check_name, reserve_name

DEFAULT_STATE_DIR = Path("/var/lib/snapctl")


def state_dir() -> Path:
    return Path(os.environ.get("SNAPCTL_STATE_DIR", DEFAULT_STATE_DIR)).absolute()


class ActivationRecord(BaseModel):
    """What ``snapctl ps``/``stop``/``logs`` know of a running activation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = 1
    name: str
    activation_id: str
    kind: str
    image: str | None
    root_pid: int
    root_start_time: float
    supervisor_pid: int
    supervisor_start_time: float
    activation_dir: str
    logs_dir: str
    host: str | None
    port: int
    published: str | None
    created: str
    # A lazy copy: its lazy-pages daemon (stopped with the copy), and whether every page has
    # arrived (None: not lazy; False: still transferring; True since pages_complete_at, which
    # was pages_complete_s after the restore started).
    lazy: bool = False
    lazy_pages_pid: int | None = None
    lazy_pages_start_time: float | None = None
    pages_complete: bool | None = None
    pages_complete_s: float | None = None
    pages_complete_at: str | None = None


class StateDir:
    def __init__(self, root: Path | None = None) -> None:
        self.root = root or state_dir()

    @property
    def activations(self) -> Path:
        return self.root / "activations"

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
        """Reserve ``name`` until the activation stops (see ``snapctl.supervision.names``)."""
        return reserve_name(self.records, name)

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

    def drop_record(self, name: str) -> None:
        self.record_path(name).unlink(missing_ok=True)
