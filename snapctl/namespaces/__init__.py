"""Fresh namespaces for one activation: the sandbox a server is launched into, its mounts, its
loopback, and reaching its network namespace from the host (HTTP probes, ``--publish``).

Fixed paths inside every sandbox (the same for the donor and every copy, so a restored tree
finds its files where the captured one left them):

- ``/run/snapctl/control``: the activation's private control directory
- ``/run/snapctl/logs``: the activation's logs (stdout/stderr go to ``server.log`` there)
- ``/dev/shm``: a tmpfs of the activation's own
"""

from snapctl.namespaces.layout import (
    SANDBOX_CONTROL_DIR,
    SANDBOX_LOG_FILE,
    SANDBOX_LOGS_DIR,
    SANDBOX_SHM_DIR,
    ActivationDirs,
    BindMount,
    SandboxSpec,
)

__all__ = [
    "SANDBOX_CONTROL_DIR",
    "SANDBOX_LOGS_DIR",
    "SANDBOX_LOG_FILE",
    "SANDBOX_SHM_DIR",
    "ActivationDirs",
    "BindMount",
    "SandboxSpec",
]
