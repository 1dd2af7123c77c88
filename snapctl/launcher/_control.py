"""The server's half of the control-file handshake: publish ready, accept one activation, report.

The wait for ``activation.json`` polls with plain sleeps on purpose: the server is checkpointed
by CRIU while it waits there, and an observer thread or an inotify descriptor in the image would
have to be restored too. Each round only probes for the file with one ``lstat``, which reads
nothing; whatever the probe finds is read through :class:`ControlDir`, with every directory
check, and the directory is checked in full at least every :data:`FULL_CHECK_S` even when
nothing appears. That keeps a 1 ms interval cheaper than full reads every 5 ms.

Once an activation is accepted no checkpoint can follow, so the wait for ``release.json`` is
woken by inotify (a pooled descriptor, see :mod:`snapctl.protocol.inotify`), and re-reads at
least every :data:`FULL_CHECK_S` in case an event is missed.

Every wait's budget shrinks by the time it waited, but by at most the intended wait per round,
so time spent frozen by CRIU does not count against ``timeout_s``; the capturer owns the
wall-clock deadline.
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
from snapctl.protocol.inotify import DirectoryWatch
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

DEFAULT_POLL_S = 0.001

# The protocol's own poll interval (vLLM reads every 50 ms): the longest a wait goes without
# checking the directory in full, or without re-reading when inotify should have woken it.
FULL_CHECK_S = 0.05

# The two blocking calls; module globals so tests can simulate a CRIU freeze in either wait.
_sleep = time.sleep


def _wait_for_event(watch: DirectoryWatch, timeout_s: float) -> None:
    watch.wait(timeout_s)


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
        first = self._poll_barrier(ControlFile.ACTIVATION)
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
        stale = [name.value for name in self.control_dir.present() if name in STALE_ON_ACTIVATION]
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
        release = self._await_after_acceptance(ControlFile.RELEASE)
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

    def _poll_barrier(self, name: ControlFile) -> dict[str, Any]:
        """Wait at the capture barrier: sleeps and ``lstat`` probes only, no descriptor."""
        path = self.control_dir.file_path(name)
        remaining = self.timeout_s
        unchecked_s = FULL_CHECK_S  # check the directory in full on the first round
        while True:
            if unchecked_s >= FULL_CHECK_S or os.path.lexists(path):
                payload = self.control_dir.read_raw(name)
                if payload is not None:
                    return payload
                unchecked_s = 0.0
            if remaining <= 0:
                raise self._timed_out(name)
            delay = min(self.poll_s, remaining)
            _sleep(delay)
            # Subtract the intended delay, not the elapsed wall time: if CRIU froze us during
            # the sleep, the frozen span must not count against timeout_s.
            remaining -= delay
            unchecked_s += delay

    def _await_after_acceptance(self, name: ControlFile) -> dict[str, Any]:
        """Wait for a file after the activation was accepted: woken by inotify."""
        try:
            watch: DirectoryWatch | None = DirectoryWatch(self.control_dir.path)
        except OSError as error:
            logger.warning("cannot watch %s, polling only: %s", self.control_dir.path, error)
            watch = None
        try:
            remaining = self.timeout_s
            while True:
                if watch is not None:
                    # Before reading: an event during the read then ends the next wait at once.
                    watch.drain()
                payload = self.control_dir.read_raw(name)
                if payload is not None:
                    return payload
                if remaining <= 0:
                    raise self._timed_out(name)
                if watch is None:
                    delay = min(self.poll_s, remaining)
                    _sleep(delay)
                    remaining -= delay
                    continue
                delay = min(FULL_CHECK_S, remaining)
                started = time.monotonic()
                _wait_for_event(watch, delay)
                # An event may end the wait early; a freeze must not make it count for more
                # than the intended delay.
                remaining -= min(time.monotonic() - started, delay)
        finally:
            if watch is not None:
                watch.close()

    def _timed_out(self, name: ControlFile) -> WaitTimeoutError:
        return WaitTimeoutError(
            f"timed out after {self.timeout_s:g} s waiting for {name.value}",
            awaited=(name.value,),
            path=self.control_dir.path,
        )
