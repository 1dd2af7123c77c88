"""A parked copy's order, with the activation and supervision stood in for (no root): a
foreground copy whose report reached no one is stopped, not supervised with no owner."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from snapctl.activation.requests import CopyRequest
from snapctl.errors import ExitStatus
from snapctl.pool.models import ActivationOrder, ParkedRecord
from snapctl.pool.supervisor import parked
from snapctl.pool.wire import order_line


def _parked(monkeypatch: pytest.MonkeyPatch, delivered: bool, detach: bool) -> dict[str, Any]:
    seen: dict[str, Any] = {"supervised": False, "stopped": 0}
    copy = object.__new__(parked._Parked)
    copy.record = ParkedRecord.model_construct(lazy_pages_pid=None)
    order = ActivationOrder(action="activate",
                            request=CopyRequest(image="/images/one", detach=detach))  # fmt: skip
    monkeypatch.setattr(copy, "read_order", lambda conn: order, raising=False)
    monkeypatch.setattr(copy, "activate", lambda request, reporter: ("session", delivered),
                        raising=False)  # fmt: skip

    def supervise(session: Any) -> int:
        seen["supervised"] = True
        return 0

    monkeypatch.setattr(copy, "supervise", supervise, raising=False)
    monkeypatch.setattr(parked, "set_niceness", lambda pid, niceness: None)
    monkeypatch.setattr("snapctl.supervision.signals.stop_all_tracked",
                        lambda: seen.__setitem__("stopped", seen["stopped"] + 1))  # fmt: skip
    ours, theirs = socket.socketpair()
    with ours, theirs:
        seen["status"] = copy.serve_order(ours)
    return seen


@pytest.mark.parametrize(("delivered", "detach"), [(True, False), (True, True), (False, True)])
def test_a_delivered_or_detached_report_is_supervised(
    monkeypatch: pytest.MonkeyPatch, delivered: bool, detach: bool
) -> None:
    seen = _parked(monkeypatch, delivered, detach)
    assert seen == {"supervised": True, "stopped": 0, "status": 0}


def test_a_foreground_report_that_reached_no_one_stops_the_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = _parked(monkeypatch, delivered=False, detach=False)
    assert seen == {"supervised": False, "stopped": 1, "status": ExitStatus.ERROR}


def test_an_order_line_is_what_the_parked_copy_reads_the_api_key_included() -> None:
    request = CopyRequest(image="/images/one", api_key_env="KEY", api_key="secret")
    activate = ActivationOrder.model_validate_json(order_line(request))
    assert activate.action == "activate" and activate.request is not None
    assert activate.request.api_key is not None
    assert activate.request.api_key.get_secret_value() == "secret"
    discard = ActivationOrder.model_validate_json(order_line(None))
    assert (discard.action, discard.request) == ("discard", None)
    assert order_line(None).endswith(b"\n") and order_line(None).count(b"\n") == 1
