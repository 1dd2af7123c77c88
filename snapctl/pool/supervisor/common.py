"""What every supervisor job shares (:mod:`snapctl.pool.supervisor.jobs`' fresh copies and
:mod:`snapctl.pool.supervisor.parked`'s parked ones): the request turned into launch options,
its pre-start checks run again where it starts, and how a supervisor lets go of its stdio or
of a start nobody owns. Runs in a supervisor process only."""

from __future__ import annotations

import dataclasses
import os

from snapctl.activation.launch import LaunchOptions
from snapctl.activation.requests import CopyRequest, publish_pair
from snapctl.statedir import StateDir

# Where a supervisor keeps the API key its request carried, for its readiness probe.
PROBE_KEY_ENV = "SNAPCTL_PROBE_API_KEY"


def launch_options(request: CopyRequest) -> LaunchOptions:
    """The request's options for the restore and the activation, with its API key in this
    supervisor's environment (where the probe reads it), always under one private name: the
    caller's own name for it must not set any other variable of a root process (LD_PRELOAD,
    PATH), nor read one of the agent's."""
    api_key_env = None
    if request.api_key is not None:
        api_key_env = PROBE_KEY_ENV
        os.environ[api_key_env] = request.api_key.get_secret_value()
    return dataclasses.replace(request.launch_options(), api_key_env=api_key_env)


def check_request(request: CopyRequest, state: StateDir | None = None) -> None:
    """What the agent refused before this start, checked again where it runs (a port or a
    name may have been taken since, a container stopped; ``state`` None: names are left to
    the activation's own reservation); its notes were shown already, and the image's owners
    were checked by the agent that sent the request."""
    from snapctl.activation.precheck import check_copy_start

    publish = publish_pair(request.publish)
    check_copy_start(
        image=request.image, allow_mismatch=request.allow_mismatch, name=request.name,
        count=request.count, publish=publish, expose=request.expose, state=state,
        note=lambda text: None, into_container=request.into_container, check_owner=False,
    )  # fmt: skip


def detach_stdio() -> None:
    """Served: the supervisor lives on alone."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def abandon_undelivered(delivered: bool, detach: bool) -> bool:
    """A foreground start whose report reached no one has no owner (its client stops it
    when it ends, and there is none): stop what started; True when it did."""
    if delivered or detach:
        return False
    from snapctl.supervision.signals import stop_all_tracked

    stop_all_tracked()
    return True
