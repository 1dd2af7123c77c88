"""What every activation shares, donor or copy: reserving its name, creating its session, the
activation itself (handshake, readiness probe, publishing) and its report."""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from snapctl.activation.container import Container, ContainerHold
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.session import Session
from snapctl.activation.states import SessionState
from snapctl.activation.tools import REAL_TOOLS, Tools
from snapctl.cgroups import CgroupError, Limits, create_cgroup
from snapctl.criu.stats import DumpStats
from snapctl.images import Manifest
from snapctl.images.lock import ImageHold
from snapctl.namespaces.layout import ActivationDirs
from snapctl.statedir import StateDir
from snapctl.statedir.names import NameReservation


class ActivationReport(BaseModel):
    """The one machine-readable record of a started activation (``--json``)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    kind: str
    image: str | None
    image_id: str | None
    activation_id: str
    root_pid: int
    pids: list[int]
    host: str | None
    port: int
    published: str | None
    logs: str
    timings_s: dict[str, float]
    image_bytes: int | None = None
    dump_stats: DumpStats | None = None
    restore_stats: dict[str, int] | None = None
    handshake_phases: list[str] = []
    # A lazy copy serves before its memory is all in place (see snapctl.criu.lazy).
    # pages_complete: None when not lazy; False while the lazy-pages daemon still transfers;
    # True once it exited 0, pages_complete_s after the restore started (at pages_complete_at).
    lazy: bool = False
    lazy_pages_pid: int | None = None
    pages_complete: bool | None = None
    pages_complete_s: float | None = None
    pages_complete_at: str | None = None
    # Taken from a node agent's warm pool: restored ahead of time, only activated now.
    from_pool: bool = False


def new_activation_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


def reserve_session_name(state: StateDir, kind: str, name: str | None) -> NameReservation:
    """Reserve the activation's name (``name``, else a fresh activation id) before anything
    starts; a name in use is refused here (see ``snapctl.statedir.names``)."""
    return state.reserve_name(name or new_activation_id(kind))


def new_session(
    state: StateDir,
    kind: str,
    name: str | None,
    reservation: NameReservation | None = None,
    *,
    options: LaunchOptions | None = None,
    image: Path | None = None,
    image_hold: ImageHold | None = None,
    container: Container | None = None,
    container_hold: ContainerHold | None = None,
    tools: Tools = REAL_TOOLS,
) -> Session:
    """A session with fresh directories, under ``reservation`` (taken here when None), for a
    server on ``options``' host and port, of ``image`` held by ``image_hold``. The session
    owns the reservation and the hold from here on and releases them when it stops; if this
    fails, they are released. In ``container`` (a copy restored into it), its cgroup is made
    where the container's decides (:meth:`Container.cgroup_layout`)."""
    if reservation is None:
        reservation = reserve_session_name(state, kind, name)
    # Unnamed, the activation goes by its id, which is what was reserved.
    activation_id = reservation.name if name is None else new_activation_id(kind)
    dirs = ActivationDirs(root=state.activations / activation_id, logs=state.logs / activation_id)
    # Tracked before its directories exist: an interrupt from here on still removes them.
    session = Session(
        name=reservation.name, activation_id=activation_id, kind=kind, dirs=dirs,
        state_dir=state, reservation=reservation, image=image, image_hold=image_hold,
        container=container, container_hold=container_hold,
    )  # fmt: skip
    if options is not None:
        session.host, session.port = options.host, options.port
    try:
        tools.sandbox.create_dirs(dirs)
        limits = options.limits if options is not None else Limits()
        if container is None:
            session.cgroup = create_cgroup(state.cgroup_prefix + activation_id, limits)
        else:
            layout = container.cgroup_layout()
            if layout is not None:
                session.cgroup = create_cgroup(
                    state.cgroup_prefix + activation_id, limits, layout=layout
                )
            elif limits.any:
                raise CgroupError(f"{limits.describe()}: container {container.reference} "
                                  "shows no cgroup hierarchy snapctl can use")  # fmt: skip
    except BaseException:
        session.stop(failed=True)
        raise
    return session


def activate_and_probe(
    session: Session,
    capture_id: str,
    options: LaunchOptions,
    publish: tuple[str, int] | None,
    timings: dict[str, float],
    *,
    tools: Tools,
) -> list[str]:
    """Handshake, then probe public HTTP through the activation's netns, then publish; the
    session goes from parked through activating to serving."""
    session.advance(SessionState.ACTIVATING)
    root = session.tree
    # Its thread enters the netns while the server validates, not after. A tree that is gone
    # already (stopped by a failing lazy transfer, say) fails the handshake, with its reason.
    with contextlib.suppress(OSError):
        session.connector = session.connector or tools.server.connect(root.pid)
    if publish is not None and session.container is not None:
        # On the container's own network (a pod's address, where its clients are) the server
        # itself listens where --publish named (restore_copy chose its host and port): nothing
        # relays.
        session.published_directly = (session.host or publish[0], session.port)
    started = tools.clock()
    phases = tools.server.handshake(
        session.control,
        capture_id=capture_id,
        activation_id=session.activation_id,
        kind="donor" if session.kind == "donor" else "copy",
        host=session.host,
        port=session.port,
        timeout_s=options.timeout_s,
        alive=root.alive,
    )
    timings["handshake"] = tools.clock() - started
    connector = session.connector = session.connector or tools.server.connect(root.pid)
    target = (session.host or "127.0.0.1", session.port)
    timings["validated_to_http_200"] = tools.server.probe(
        connector, target[0], target[1], api_key=options.api_key, timeout_s=options.timeout_s,
        alive=root.alive,
    )  # fmt: skip
    session.memory.serving()
    if publish is not None and session.container is None:
        # Only once it serves: a client connecting earlier would reach nothing.
        session.publisher = tools.server.publish(connector, publish, target)
    session.remember_tree()
    session.advance(SessionState.SERVING)
    session.save_record()
    return phases


def activation_report(
    session: Session,
    manifest: Manifest,
    timings: dict[str, float],
    phases: list[str],
    **details: Any,
) -> ActivationReport:
    """The report of an activation that serves: what every kind has, read from its session
    and image, plus ``details``, the fields of its own kind."""
    return ActivationReport(
        name=session.name,
        kind=session.kind,
        image=None if session.image is None else str(session.image),
        image_id=manifest.image_id,
        activation_id=session.activation_id,
        root_pid=session.tree.pid,
        pids=session.current_pids,
        host=session.host,
        port=session.port,
        published=session.published,
        logs=str(session.dirs.logs),
        timings_s={k: round(v, 6) for k, v in timings.items()},
        image_bytes=manifest.total_bytes,
        handshake_phases=phases,
        **session.memory.report_fields(),
        **details,
    )
