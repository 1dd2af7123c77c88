"""TEMPORARY (issue 19, until issue 18 lands on main): ``restore_copy`` and ``activate_copy``
with the signatures the lead's snapctl.activation.copy will have, built on today's
``start_copy``: it runs in a thread whose ``before_activation`` hook parks it on an event
until the activation order. Delete this module, and import both from
snapctl.activation.copy, once main has them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapctl.activation.copy import Progress, start_copy
from snapctl.activation.donor import ActivationReport, reserve_session_name
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import NativeStep
from snapctl.activation.session import Session
from snapctl.criu import CriuBinary
from snapctl.images import Manifest, load_manifest
from snapctl.supervision.names import NameReservation
from snapctl.supervision.state import StateDir


class _Discarded(Exception):
    """Raised in the hook to end a parked copy that will never be activated."""


@dataclass
class ParkedCopy:
    """A restored copy waiting at the activation barrier (``session``), and its manifest."""

    session: Session
    manifest: Manifest
    _options: LaunchOptions
    _thread: threading.Thread
    _order: threading.Event
    _progress: list[Progress]
    _outcome: dict[str, Any] = field(default_factory=dict)
    _name: str | None = None
    _publish: tuple[str, int] | None = None
    _discard: bool = False

    def discard(self) -> None:
        """Never activated: stop it and wait until it is cleaned up."""
        self._discard = True
        self._order.set()
        self._thread.join()


def restore_copy(
    image: Path,
    options: LaunchOptions,
    *,
    criu: CriuBinary,
    native: NativeStep,
    state: StateDir,
    progress: Progress,
    lazy: bool = False,
    reservation: NameReservation | None = None,
) -> ParkedCopy:
    """Restore a copy and return it parked (its server has not seen activation.json)."""
    parked_at = threading.Event()
    order = threading.Event()
    current: list[Progress] = [progress]
    holder: dict[str, Any] = {}
    outcome: dict[str, Any] = {}

    def hook(session: Session) -> None:
        holder["session"] = session
        parked_at.set()
        order.wait()
        if holder.get("abort") or holder["parked"]._discard:
            raise _Discarded
        parked: ParkedCopy = holder["parked"]

        # start_copy publishes what it was given (nothing): publish the order's instead.
        def publish_ordered(_given: tuple[str, int] | None) -> None:
            Session.publish(session, parked._publish)

        session.publish = publish_ordered  # type: ignore[method-assign,assignment]
        if parked._name is not None and parked._name != session.name:
            mine = reserve_session_name(state, "copy", parked._name)
            if session.reservation is not None:
                session.reservation.release()
            session.reservation, session.name = mine, mine.name

    def run() -> None:
        try:
            outcome["result"] = start_copy(
                image, options, criu=criu, native=native, publish=None, state=state,
                progress=lambda step: current[0](step), before_activation=hook, lazy=lazy,
                reservation=reservation,
            )  # fmt: skip
        except BaseException as error:
            outcome["error"] = error
        finally:
            parked_at.set()

    thread = threading.Thread(target=run, name="parked-copy", daemon=True)
    thread.start()
    try:
        parked_at.wait()
    except BaseException:  # interrupted while restoring: the hook ends the copy
        holder["abort"] = True
        order.set()
        thread.join()
        raise
    if "session" not in holder:
        thread.join()
        raise outcome["error"]
    parked = ParkedCopy(
        session=holder["session"], manifest=load_manifest(image.absolute()), _options=options,
        _thread=thread, _order=order, _progress=current, _outcome=outcome,
    )  # fmt: skip
    holder["parked"] = parked
    return parked


def activate_copy(
    parked: ParkedCopy,
    options: LaunchOptions,
    *,
    publish: tuple[str, int] | None,
    progress: Progress,
    name: str | None = None,
) -> tuple[Session, ActivationReport]:
    """Activate a parked copy (handshake, probe, publish), renamed to ``name`` if given."""
    # start_copy reads these from the options it was given, after the hook returns.
    parked._options.api_key_env = options.api_key_env
    parked._options.timeout_s = options.timeout_s
    parked._progress[0] = progress
    parked._name, parked._publish = name, publish
    parked._order.set()
    parked._thread.join()
    if "error" in parked._outcome:
        raise parked._outcome["error"]
    session, report = parked._outcome["result"]
    return session, report


def discard_parked(parked: ParkedCopy) -> None:
    """Stop a parked copy that will never be activated, and clean up after it."""
    parked.discard()
