"""snapctl's host state directory, visible to every package without importing supervision
(light imports: no psutil): its layout (:class:`StateDir`), the activation records in it, and
activation names, which become file names there and are reserved by a lock beside the record.
"""

from snapctl.statedir.layout import DEFAULT_STATE_DIR, StateDir, state_dir
from snapctl.statedir.records import ActivationRecord

__all__ = ["DEFAULT_STATE_DIR", "ActivationRecord", "StateDir", "state_dir"]
