"""The server's half of the control-file handshake: publish ready, accept one activation, report.

Waits here poll with plain sleeps on purpose: the server is checkpointed by CRIU while it
waits, and an observer thread or an inotify descriptor in the image would have to be restored
too. The poll budget shrinks by the intended sleep per round, not by wall time, so time spent
frozen by CRIU does not count against ``timeout_s``; the capturer owns the wall-clock deadline.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from typing import Any, Literal

from snapctl.errors import ProtocolError, WaitTimeoutError
from snapctl.protocol.atomic import encode_json, validate_model
from snapctl.protocol.controldir import ControlDir
from snapctl.protocol.models import (
    STALE_ON_ACTIVATION,
    Activation,
    CaptureReady,
    Challenge,
    ControlFile,
    ErrorReport,
    Oracle,
    Phase,
    Status,
)

logger = logging.getLogger(__name__)

DEFAULT_POLL_S = 0.005

# The one blocking call of the barrier; a module global so tests can simulate a CRIU freeze.
_sleep = time.sleep


def new_nonce() -> str:
    """A fresh challenge nonce (uuid4 draws from os.urandom, never from ``random``)."""
    return uuid.uuid4().hex


def describe_error(error: BaseException) -> str:
    """The message of ``error``, its type name when empty; never raises."""
    try:
        return str(error) or type(error).__name__
    except Exception:
        return f"<unprintable {type(error).__name__}>"


def _canonical(payload: dict[str, Any]) -> bytes:
    # Byte-level comparison: Python's == would treat 1, 1.0 and True as the same value.
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode("utf-8")


class ServerControl:
    """One capture's control files, seen from the server. Single use: one activation at most."""

    def __init__(
        self, control_dir: ControlDir, capture_id: str, timeout_s: float, poll_s: float
    ) -> None:
        self.control_dir = control_dir
        self.capture_id = capture_id
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        # Set once an activation passed its checks and was challenged; named in error.json.
        self.activation: Activation | None = None
        self._ready_published = False

    def publish_ready(self, oracle: Oracle) -> None:
        """Publish only after preparation and the rehearsal have completed."""
        if self._ready_published:
            raise RuntimeError("capture-ready.json was already published")
        ready = CaptureReady(capture_id=self.capture_id, pid=os.getpid(), oracle=oracle)
        self.control_dir.write(ready)
        self._ready_published = True

    def wait_for_activation(self) -> Activation:
        """Accept one fresh activation and complete the challenge/release handshake."""
        if not self._ready_published or self.activation is not None:
            raise RuntimeError("wait_for_activation needs a published capture-ready.json, once")
        activation_path = self.control_dir.file_path(ControlFile.ACTIVATION)
        first = self._poll(ControlFile.ACTIVATION)
        activation = validate_model(activation_path, first, Activation)
        if activation.capture_id != self.capture_id:
            raise ProtocolError(
                "activation.json names a different capture_id", path=activation_path
            )
        if not activation.native_complete:
            raise ProtocolError(
                "activation.json has native_complete false: native restore must finish first",
                path=activation_path,
            )
        stale = [name.value for name in STALE_ON_ACTIVATION if self.control_dir.exists(name)]
        if stale:
            raise ProtocolError(
                f"stale activation control: {', '.join(stale)} already present",
                path=self.control_dir.path,
            )
        self.activation = activation
        # Drawn only now, after acceptance: the nonce is not in the captured image and a
        # release saved by an earlier activation cannot be replayed.
        challenge = Challenge(
            capture_id=self.capture_id,
            activation_id=activation.activation_id,
            nonce=new_nonce(),
        )
        self.control_dir.write(challenge)
        release = self._poll(ControlFile.RELEASE)
        if _canonical(release) != encode_json(challenge):
            raise ProtocolError(
                "release.json does not match challenge.json",
                path=self.control_dir.file_path(ControlFile.RELEASE),
            )
        again = self.control_dir.read_raw(ControlFile.ACTIVATION)
        if again is None or _canonical(again) != _canonical(first):
            raise ProtocolError(
                "activation.json changed during the challenge", path=activation_path
            )
        return activation

    def write_status(self, phase: Literal["recovering", "validated"]) -> None:
        """Record recovery progress; ``validated`` does not mean the listener is up."""
        if self.activation is None:
            raise RuntimeError("status.json needs an accepted activation")
        status = Status(
            capture_id=self.capture_id,
            activation_id=self.activation.activation_id,
            phase=phase,
        )
        self.control_dir.write(status, overwrite=True)

    def write_error(self, phase: Phase | str, error: BaseException) -> BaseException | None:
        """Record the failure; return (never raise) a failure to record it."""
        try:
            report = ErrorReport(
                capture_id=self.capture_id,
                activation_id=None if self.activation is None else self.activation.activation_id,
                phase=str(phase),
                error_type=type(error).__name__,
                error=describe_error(error),
            )
            self.control_dir.write(report, overwrite=True)
        except Exception as secondary:
            # The primary error is what the caller must see; this one is only attached to it.
            logger.warning("could not write error.json: %s", secondary)
            return secondary
        return None

    def _poll(self, name: ControlFile) -> dict[str, Any]:
        remaining = self.timeout_s
        while True:
            payload = self.control_dir.read_raw(name)
            if payload is not None:
                return payload
            if remaining <= 0:
                raise WaitTimeoutError(
                    f"timed out after {self.timeout_s:g} s waiting for {name.value}",
                    awaited=(name.value,),
                    path=self.control_dir.path,
                )
            delay = min(self.poll_s, remaining)
            _sleep(delay)
            # Subtract the intended delay, not the elapsed wall time: if CRIU froze us during
            # the sleep, the frozen span must not count against timeout_s.
            remaining -= delay
