"""The agent's API over its socket: permissions, strict validation, streaming, metrics, the
TCP listener's token; and the CLI through it giving what it gives in-process."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ValidationError

from snapctl.agent.client import AgentClient, connect
from snapctl.agent.daemon import (
    Agent,
    AgentOptions,
    AgentRunningError,
    ListenError,
    TokenFileError,
)
from snapctl.agent.errors import AgentError
from snapctl.agent.metrics import AgentMetrics
from snapctl.cli import main
from snapctl.errors import ExitStatus
from snapctl.pool import ParkedHandle, PoolListing
from snapctl.pool.models import ParkedCopyRow, PoolEntry, PoolTarget
from snapctl.statedir import ActivationRecord, StateDir
from snapctl.supervision.memory import KsmStatus
from tests.agent.conftest import FakePool, FakeSpawner, RunningAgent, make_report
from tests.images.factories import publish_sample

# What the CLI's fast path never imports (the agent's HTTP server, aiohttp, included).
HEAVY = {"click", "pydantic", "rich", "psutil", "pyroute2", "watchdog", "prometheus_client",
         "aiohttp"}  # fmt: skip


def ready_parked(running_agent: RunningAgent, tmp_path: Path) -> tuple[Path, ParkedHandle]:
    """An image directory, and a parked copy of it the fake pool hands out on a take."""
    image = tmp_path / "image"
    image.mkdir()
    handle = ParkedHandle(id="pool-0123456789ab", image=str(image),
                          socket=tmp_path / "order.sock", supervisor_pid=1,
                          supervisor_start_time=1.0)  # fmt: skip
    running_agent.pool.ready.append(handle)
    return image, handle


def raw(where: Path | int, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` as is to a unix socket, or to a TCP port on 127.0.0.1; the status and
    the body of the answer."""
    if isinstance(where, int):
        connection = socket.create_connection(("127.0.0.1", where), timeout=10)
    else:
        connection = socket.socket(socket.AF_UNIX)
        connection.settimeout(10)
        connection.connect(str(where))
    with connection as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def metrics_of(path: Path) -> bytes:
    status, body = raw(path, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 200
    return body


def post(path: Path, target: str, body: bytes) -> tuple[int, dict[str, Any]]:
    status, answer = raw(
        path,
        f"POST {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body,
    )
    return status, json.loads(answer)


def test_the_socket_is_0600_and_a_second_agent_is_refused(running_agent: RunningAgent) -> None:
    mode = running_agent.socket.stat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    second = Agent(
        running_agent.state,
        AgentOptions(socket=running_agent.socket),
        spawner_factory=FakeSpawner,
        pool_factory=FakePool,
    )  # type: ignore[arg-type]
    with pytest.raises(AgentRunningError) as refused:
        second.start()
    assert refused.value.exit_status == ExitStatus.CONFLICT
    assert running_agent.socket.exists()  # the refused one removed nothing


def test_stopping_removes_the_socket_and_discards_the_pool(tmp_path: Path) -> None:
    spawner = FakeSpawner()
    agent = Agent(StateDir(tmp_path), AgentOptions(), spawner_factory=lambda: spawner,  # type: ignore[arg-type,return-value]
                  pool_factory=FakePool)  # fmt: skip
    agent.start()
    pool = agent.pool
    assert isinstance(pool, FakePool) and (tmp_path / "agent.sock").exists()
    agent.stop()
    assert not (tmp_path / "agent.sock").exists() and pool.closed and spawner.closed
    assert connect(tmp_path / "agent.sock") is None


def test_unreadable_pool_targets_stop_the_start_and_undo_it(tmp_path: Path) -> None:
    from snapctl.pool import WarmPool
    from snapctl.pool.warm import PoolTargetsError

    targets = tmp_path / "pool" / "targets.json"
    targets.parent.mkdir(parents=True)
    targets.write_text('{"version": 1, "targets": [{"image": "/images/one", "size": "two"}]}')
    spawner = FakeSpawner()
    agent = Agent(StateDir(tmp_path), AgentOptions(), spawner_factory=lambda: spawner,  # type: ignore[arg-type,return-value]
                  pool_factory=WarmPool)  # fmt: skip
    with pytest.raises(PoolTargetsError, match=r"targets\.0\.size"):
        agent.start()
    assert spawner.closed and not (tmp_path / "agent.sock").exists()
    assert "two" in targets.read_text()  # kept for its owner to repair
    again = Agent(StateDir(tmp_path), AgentOptions(), spawner_factory=FakeSpawner,  # type: ignore[arg-type]
                  pool_factory=FakePool)  # fmt: skip
    again.start()  # the lock was let go
    again.stop()


@pytest.mark.parametrize(
    ("target", "body", "status", "reason"),
    [
        ("/v1/copies", b"{not json", 400, "not a JSON object"),
        ("/v1/copies", b"[]", 422, "invalid CopyRequest"),
        ("/v1/copies", b'{"image": "/x", "bogus": 1}', 422, "bogus: Extra inputs"),
        ("/v1/copies", b'{"image": "relative"}', 422, "image: String should match"),
        ("/v1/copies", b'{"image": "/x", "count": 65}', 422, "count: Input should be less"),
        ("/v1/copies", b'{"image": "/x", "timeout_s": -1}', 422, "timeout_s"),
        ("/v1/copies", b'{"image": "/x", "count": "2"}', 422, "count: Input should be a valid"),
        ("/v1/activations/a/stop", b'{"timeout_s": 0}', 422, "positive, finite"),
        ("/v1/activations/a/stop", b'{"timeout_s": 1e10}', 422, "at most 2592000"),
        ("/v1/pool/rm", b'{"image": "/a\\u0000b"}', 422, "image: holds NUL"),
        ("/v1/copies", b'{"image": "/x", "api_key": "k\\u0000"}', 422, "api_key: holds NUL"),
        (
            "/v1/copies",
            b'{"image": "/x", "server_argv": ["a", "\\u0000"]}',
            422,
            "server_argv.1: holds",
        ),
        ("/v1/activations/..%2f/stop", b"{}", 404, "no such path"),
        ("/v1/nothing", b"{}", 404, "no such path"),
        ("/elsewhere", b"{}", 404, "under /v1/"),
        ("/v1/activations", b"{}", 405, "POST is not allowed"),
        ("/v1/pool/set", b'{"image": "/x", "size": -1}', 422, "size"),
    ],
)
def test_malformed_requests_are_refused_with_the_reason(
    running_agent: RunningAgent, target: str, body: bytes, status: int, reason: str
) -> None:
    got, answer = post(running_agent.socket, target, body)

    assert got == status and reason in answer["error"], answer
    assert answer["status"] == ExitStatus.USAGE
    assert "Traceback" not in answer["error"]
    assert running_agent.spawner.jobs == []


@pytest.mark.parametrize(
    ("depth", "status", "reason"),
    [(100, 422, "image: holds NUL"), (1000, 400, "not a JSON object"),
     (200000, 400, "not a JSON object")],
)  # fmt: skip
def test_a_deeply_nested_body_is_refused_never_a_failure(
    running_agent: RunningAgent, depth: int, status: int, reason: str
) -> None:
    """A string holding NUL sends the body to the NUL check, which must not recurse (nor
    the JSON parser) past its depth: a refusal, whatever the nesting."""
    nested = b"[" * depth + b"]" * depth
    got, answer = post(running_agent.socket, "/v1/copies",
                       b'{"image": "/x\\u0000", "a": ' + nested + b"}")  # fmt: skip
    assert (got, answer["status"]) == (status, ExitStatus.USAGE) and reason in answer["error"]
    got, answer = post(running_agent.socket, "/v1/copies", nested)
    assert got in (400, 422) and answer["status"] == ExitStatus.USAGE, answer
    assert running_agent.spawner.jobs == []


def test_a_refused_body_is_not_echoed(running_agent: RunningAgent) -> None:
    body = json.dumps({"image": "/x", "api_key": 12345678, "count": "secret-value"}).encode()
    got, answer = post(running_agent.socket, "/v1/copies", body)
    assert got == 422 and "secret-value" not in json.dumps(answer)


GET_POOL = b"GET /v1/pool HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


class _Port(BaseModel):
    port: int


def _validation_error(value: str) -> ValidationError:
    try:
        _Port.model_validate({"port": value})
    except ValidationError as error:
        return error
    raise AssertionError("validated")


@pytest.mark.parametrize("raised", ["itself", "made from it", "while handling it"])
def test_an_unexpected_validation_error_says_no_input(
    running_agent: RunningAgent, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, raised: str,
) -> None:  # fmt: skip
    """A bug in the agent that is a validation error (or comes from one) of a secret: neither
    the client nor the log gets the secret, the client still gets where and why."""

    def listing() -> PoolListing:
        error = _validation_error("sk-s3cret")
        if raised == "itself":
            raise error
        try:
            raise error
        except ValidationError as caught:
            if raised == "made from it":
                raise RuntimeError(f"cannot list: {caught}") from caught
            raise RuntimeError(f"cannot list: {caught}")  # noqa: B904 (its context is the case)

    monkeypatch.setattr(running_agent.pool, "listing", listing)
    caplog.set_level(logging.DEBUG)
    status, body = raw(running_agent.socket, GET_POOL)
    answer = json.loads(body)
    assert status == 500 and answer["status"] == ExitStatus.ERROR
    assert "s3cret" not in answer["error"] and "s3cret" not in caplog.text
    assert "unexpected error" in caplog.text and "listing" in caplog.text  # the frames stay
    if raised == "itself":
        assert answer["error"] == ("unexpected ValidationError in the agent: _Port: port: "
                                   "Input should be a valid integer, unable to parse string "
                                   "as an integer")  # fmt: skip


def test_an_unexpected_error_says_its_text(
    running_agent: RunningAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    def listing() -> PoolListing:
        raise RuntimeError("the pool's lock is gone")

    monkeypatch.setattr(running_agent.pool, "listing", listing)
    status, body = raw(running_agent.socket, GET_POOL)
    assert status == 500 and json.loads(body)["error"] == (
        "unexpected RuntimeError in the agent: the pool's lock is gone"
    )


def test_oversized_and_chunked_bodies_are_refused(running_agent: RunningAgent) -> None:
    status, _ = raw(running_agent.socket, b"POST /v1/copies HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Length: 99999999\r\nConnection: close\r\n\r\n")  # fmt: skip
    assert status == 413
    status, _ = raw(running_agent.socket, b"POST /v1/copies HTTP/1.1\r\nHost: x\r\n"
                    b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                    b"0\r\n\r\n")  # fmt: skip
    assert status == 411


def test_an_unknown_activation_is_404_with_the_cli_message(running_agent: RunningAgent) -> None:
    client = AgentClient(running_agent.socket)
    with pytest.raises(AgentError) as refused:
        client.call("POST", "/activations/nobody/stop", {})
    assert refused.value.message == "no activation named 'nobody' (see snapctl ps)"


def _record(state: StateDir, name: str) -> None:
    state.ensure()
    state.save_record(
        ActivationRecord(
            name=name, activation_id=f"copy-{name}", kind="copy", image="/images/one",
            root_pid=999999, root_start_time=1.0, supervisor_pid=999998,
            supervisor_start_time=1.0, activation_dir="/nowhere", logs_dir="/nowhere/logs",
            host="127.0.0.1", port=8000, published="127.0.0.1:18000",
            created="2026-01-01T00:00:00+00:00",
        )
    )  # fmt: skip


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_ps_with_and_without_the_agent_gives_the_same_output(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    _record(running_agent.state, "one")
    _record(running_agent.state, "two")
    for args in (["ps", "--json"], ["ps"]):
        through = run_cli(capsys, *args)
        local = run_cli(capsys, "--no-agent", *args)
        assert through == local and through[0] == 0
    rows = json.loads(run_cli(capsys, "ps", "--json")[1])
    assert [row["name"] for row in rows] == ["one", "two"]
    assert rows[0]["running"] is False and rows[0]["supervised"] is False
    assert "one" in run_cli(capsys, "ps")[1]


def test_ps_rows_are_the_api_s_activation_rows(running_agent: RunningAgent) -> None:
    from snapctl.agent.api import ActivationRow
    from snapctl.supervision.listing import activation_rows

    _record(running_agent.state, "one")
    rows = AgentClient(running_agent.socket).call("GET", "/activations")
    assert rows == activation_rows(running_agent.state)
    assert [ActivationRow.model_validate(row).model_dump(mode="json") for row in rows] == rows


def test_logs_of_a_name_that_is_another_s_id_are_the_name_s_either_way(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from tests.statedir.test_lookup import save

    state = running_agent.state
    for name, activation_id in (("alpha", "copy-1"), ("copy-1", "copy-2"), ("omega", "copy-3")):
        record = save(state, name, activation_id)
        (Path(record.logs_dir)).mkdir(parents=True)
        (Path(record.logs_dir) / "server.log").write_text(f"log of {name}\n")
    for asked, shown in (("copy-1", "copy-1"), ("copy-3", "omega"), ("alpha", "alpha")):
        through = run_cli(capsys, "logs", asked)
        assert through == (0, f"log of {shown}\n", "")
        assert through == run_cli(capsys, "--no-agent", "logs", asked)
    assert run_cli(capsys, "logs", "nobody") == run_cli(capsys, "--no-agent", "logs", "nobody")


def test_stop_of_an_unknown_name_fails_the_same_either_way(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(capsys, "stop", "nobody") == run_cli(capsys, "--no-agent", "stop", "nobody")
    code, _, err = run_cli(capsys, "stop", "nobody")
    assert code == ExitStatus.ERROR and "no activation named 'nobody'" in err


def test_gc_with_and_without_the_agent_gives_the_same_json(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(capsys, "gc", "--json") == run_cli(capsys, "--no-agent", "gc", "--json")


def test_copy_through_the_agent_streams_its_report(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    image = tmp_path / "image"
    image.mkdir()
    monkeypatch.setenv("TEST_KEY", "s3cret")
    code, out, _ = run_cli(capsys, "copy", "--image", str(image), "--no-lazy", "--detach",
                           "--json", "--name", "one", "--api-key-env", "TEST_KEY")  # fmt: skip
    assert code == 0 and json.loads(out) == make_report()
    (job,) = running_agent.spawner.jobs
    request = job["request"]
    assert request["image"] == str(image) and request["name"] == "one"
    assert request["lazy"] is False and request["detach"] is True
    assert request["api_key"] == "s3cret"  # the key's value travels to the supervisor only
    metrics = metrics_of(running_agent.socket)
    assert b'snapctl_copies_started_total{source="restore"} 1.0' in metrics
    assert b'snapctl_copy_phase_seconds_count{phase="restore",source="restore"} 1.0' in metrics


def test_copy_takes_a_parked_copy_when_one_is_ready(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    image, handle = ready_parked(running_agent, tmp_path)
    taken: list[Any] = []

    def activate(handle: ParkedHandle, request: Any, progress: Any) -> dict[str, Any]:
        taken.append((handle, request))
        progress("", "activating the copy")
        return make_report(from_pool=True)

    monkeypatch.setattr("snapctl.pool.serve.activate_taken", activate)
    code, out, _ = run_cli(capsys, "copy", "--image", str(image), "--detach", "--json")
    assert code == 0 and json.loads(out)["from_pool"] is True
    assert taken[0][0] is handle and running_agent.spawner.jobs == []
    # None: the pool's copy decides (lazy only if the request says so).
    assert taken[0][1].lazy is None
    metrics = metrics_of(running_agent.socket)
    assert b'snapctl_copies_started_total{source="pool"} 1.0' in metrics
    assert b'snapctl_copies_started_total{source="restore"}' not in metrics


def test_a_failed_copy_exits_with_its_status_and_its_message(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    image = tmp_path / "image"
    image.mkdir()
    running_agent.spawner.script = [
        {"error": "name 'one' is in use", "status": 6, "phase": None, "path": None,
         "log_tail": None},
    ]  # fmt: skip
    code, out, err = run_cli(capsys, "copy", "--image", str(image), "--no-lazy", "--detach")
    assert code == ExitStatus.CONFLICT and out == ""
    assert err.strip() == "error: name 'one' is in use"
    metrics = metrics_of(running_agent.socket)
    assert b'snapctl_failures_total{phase="unknown",what="copy"} 1.0' in metrics


def test_a_usage_error_reads_as_click_s_either_way(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    image = tmp_path / "image"
    image.mkdir()
    args = ["copy", "--image", str(image), "--no-lazy", "--detach", "--expose"]
    through = run_cli(capsys, *args)
    assert through[0] == ExitStatus.USAGE and "--expose only widens --publish" in through[2]
    assert through == run_cli(capsys, "--no-agent", *args)


def test_pool_set_ls_rm_through_the_agent(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    image = tmp_path / "image"
    image.mkdir()
    code, out, _ = run_cli(capsys, "pool", "set", "--image", str(image), "--size", "2",
                           "--max-memory", "1G", "--json")  # fmt: skip
    assert code == 0 and json.loads(out)["max_memory"] == 1 << 30
    code, out, _ = run_cli(capsys, "pool", "ls", "--json")
    assert json.loads(out)["entries"][0]["target"]["size"] == 2
    assert str(image) in run_cli(capsys, "pool", "ls")[1]
    for flag, lazy, shown in (("--lazy", True, "(lazy,"), ("--no-lazy", False, "(not lazy,")):
        code, out, _ = run_cli(capsys, "pool", "set", "--image", str(image), "--size", "1", flag)
        assert code == 0 and shown in out and running_agent.pool.targets[str(image)].lazy is lazy
    code, out, _ = run_cli(capsys, "pool", "set", "--image", str(image), "--size", "1",
                           "--memory", "1g", "--cpus", "0.5")  # fmt: skip
    target = running_agent.pool.targets[str(image)]
    assert code == 0 and (target.memory_bytes, target.cpus) == (1 << 30, 0.5)
    assert "each copy --memory 1g --cpus 0.5" in out
    code, out, _ = run_cli(capsys, "pool", "rm", "--image", str(image))
    assert code == 0 and running_agent.pool.targets == {}
    code, _, err = run_cli(capsys, "pool", "set", "--image", str(tmp_path / "none"), "--size", "1")
    assert code == ExitStatus.VERIFY_FAILED and "neither an image directory" in err


POOL_GAUGES = {
    "snapctl_pool_target_size", "snapctl_pool_parked", "snapctl_pool_memory_bytes",
    "snapctl_pool_cgroup_memory_bytes", "snapctl_pool_copy_memory_limit_bytes",
}  # fmt: skip
KSM_GAUGES = {"snapctl_ksm_running", "snapctl_ksm_saved_bytes"}


def test_pool_ls_and_the_pool_s_gauges_show_each_parked_copy(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    image = str(tmp_path / "image")
    rows = (
        ParkedCopyRow(id="pool-00000000000a", state="parked", age_s=12.4,
                      memory_bytes=96 << 20, supervisor_pid=10, root_pid=11,
                      cgroup="/snapctl/1f2e3d4c-copy-0a", cgroup_memory_bytes=150 << 20,
                      memory_limit_bytes=1 << 30),
        ParkedCopyRow(id="pool-00000000000b", state="restoring", age_s=0.6,
                      memory_bytes=None, supervisor_pid=12, root_pid=None),
    )  # fmt: skip
    entry = PoolEntry(target=PoolTarget(image=image, size=3, lazy=True, max_memory=1 << 30,
                                        memory_bytes=1 << 30),
                      image_id="0" * 64, memory_bytes=96 << 20, parked=rows)  # fmt: skip
    ksm = KsmStatus(running=True, saved_bytes=3 << 30, pages_sharing=745_000, full_scans=9)
    listing = PoolListing(entries=(entry,), memory_bytes=96 << 20, ksm=ksm)
    monkeypatch.setattr(running_agent.pool, "listing", lambda: listing)

    code, out, _ = run_cli(capsys, "pool", "ls", "--json")
    assert code == 0 and PoolListing.model_validate_json(out) == listing
    code, out, _ = run_cli(capsys, "pool", "ls")
    cells = [[cell.strip() for cell in line.strip("│").split("│")]
             for line in out.splitlines() if line.startswith("│")]  # fmt: skip
    assert cells == [
        [image, "1/3", "lazy", "96 MiB", "1024 MiB", "", "", "", "", "", "", ""],
        ["", "", "", "96 MiB", "", "pool-00000000000a", "parked", "12 s",
         "/snapctl/1f2e3d4c-copy-0a", "150 MiB", "1024 MiB", ""],
        ["", "", "", "-", "", "pool-00000000000b", "restoring", "1 s", "-", "-", "-", ""],
    ]  # fmt: skip
    head = [cell.strip() for cell in out.splitlines()[1].strip("┃").split("┃")]
    assert head[8:] == ["cgroup", "charged", "limit", "last failure"]
    assert out.splitlines()[-1] == "KSM running: 3.00 GiB saved by 745000 shared pages"

    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics_of(running_agent.socket).decode())
        for sample in family.samples
        if sample.name in POOL_GAUGES | KSM_GAUGES
    }
    assert samples == {
        ("snapctl_pool_target_size", (("image", image),)): 3,
        ("snapctl_pool_parked", (("image", image), ("state", "parked"))): 1,
        ("snapctl_pool_parked", (("image", image), ("state", "restoring"))): 1,
        ("snapctl_pool_memory_bytes", (("image", image),)): 96 << 20,
        ("snapctl_pool_cgroup_memory_bytes", (("image", image),)): 150 << 20,
        ("snapctl_pool_copy_memory_limit_bytes", (("image", image),)): 1 << 30,
        ("snapctl_ksm_running", ()): 1,
        ("snapctl_ksm_saved_bytes", ()): 3 << 30,
    }


def test_each_activation_s_memory_cgroup_charge_and_limit_are_gauges() -> None:
    rows = [
        {"name": "one", "kind": "copy", "running": True, "memory_bytes": 80 << 20,
         "cgroup_memory_bytes": 120 << 20, "memory_limit_bytes": 1 << 30},
        {"name": "two", "kind": "donor", "running": True, "memory_bytes": 90 << 20,
         "cgroup_memory_bytes": 130 << 20, "memory_limit_bytes": None},
        {"name": "gone", "kind": "copy", "running": False, "memory_bytes": None,
         "cgroup_memory_bytes": None, "memory_limit_bytes": 1 << 30},
    ]  # fmt: skip
    metrics = AgentMetrics()
    metrics.watch_activations(lambda: rows)
    samples = {
        (sample.name, sample.labels["name"]): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
        if sample.name.startswith("snapctl_activation_")
    }
    assert samples == {
        ("snapctl_activation_memory_bytes", "one"): 80 << 20,
        ("snapctl_activation_memory_bytes", "two"): 90 << 20,
        ("snapctl_activation_cgroup_memory_bytes", "one"): 120 << 20,
        ("snapctl_activation_cgroup_memory_bytes", "two"): 130 << 20,
        ("snapctl_activation_cgroup_memory_limit_bytes", "one"): 1 << 30,
    }


@pytest.mark.parametrize("share", [True, False])
def test_the_agent_starts_the_hosts_ksm_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    share: bool,
) -> None:  # fmt: skip
    caplog.set_level("INFO")
    calls: list[str] = []
    monkeypatch.setattr("snapctl.agent.daemon.enable_ksm", lambda: calls.append("ksm") or True)
    options = AgentOptions(socket=tmp_path / "agent.sock", share_memory=share)
    agent = Agent(StateDir(tmp_path), options, spawner_factory=FakeSpawner,  # type: ignore[arg-type]
                  pool_factory=FakePool)  # fmt: skip
    agent.start()
    agent.stop()
    assert calls == (["ksm"] if share else [])
    assert ("started the host's KSM" in caplog.text) is share


def test_the_metrics_listener_serves_metrics_and_nothing_else(tmp_path: Path) -> None:
    options = AgentOptions(socket=tmp_path / "agent.sock", metrics_listen=("127.0.0.1", 0))
    agent = Agent(StateDir(tmp_path), options, spawner_factory=FakeSpawner,  # type: ignore[arg-type]
                  pool_factory=FakePool)  # fmt: skip
    agent.start()
    try:
        (port,) = [a[1] for a in agent.addresses if isinstance(a, tuple)]

        def ask(request: str) -> tuple[int, bytes]:
            return raw(port, f"{request}\r\nHost: x\r\nConnection: close\r\n\r\n".encode())

        status, body = ask("GET /metrics HTTP/1.1")
        assert status == 200 and b"# TYPE snapctl_copies_started_total counter" in body
        for request in ("GET /v1/version HTTP/1.1", "GET /v1/activations HTTP/1.1",
                        "POST /v1/pool/rm HTTP/1.1"):  # fmt: skip
            status, body = ask(request)
            assert status == 404 and b"serves only GET /metrics" in body, (request, body)
        # The API itself is on the socket, as ever.
        assert AgentClient(tmp_path / "agent.sock").call("GET", "/version")["api"] == 1
    finally:
        agent.stop()


def test_no_secret_reaches_the_agent_s_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The API key a copy carries and the TCP listener's bearer token, right or wrong."""
    token = "k" * 40
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "token").chmod(0o600)
    state = StateDir(tmp_path / "state")
    options = AgentOptions(socket=state.root / "agent.sock", listen=("127.0.0.1", 0),
                           token_file=tmp_path / "token")  # fmt: skip
    agent = Agent(state, options, spawner_factory=FakeSpawner,  # type: ignore[arg-type]
                  pool_factory=FakePool)  # fmt: skip
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(state.root))
    monkeypatch.delenv("SNAPCTL_AGENT_SOCKET", raising=False)
    monkeypatch.delenv("SNAPCTL_NO_AGENT", raising=False)
    monkeypatch.setenv("TEST_KEY", "the-api-key-s3cret")
    caplog.set_level(logging.DEBUG)
    agent.start()
    try:
        image = tmp_path / "image"
        image.mkdir()
        code, _, _ = run_cli(capsys, "copy", "--image", str(image), "--no-lazy", "--detach",
                             "--json", "--name", "one", "--api-key-env", "TEST_KEY")  # fmt: skip
        assert code == 0
        port = next(a for a in agent.addresses if isinstance(a, tuple))[1]
        for bearer in (token, "wrong-" + token):
            request = (f"GET /v1/nowhere?token={bearer} HTTP/1.1\r\nHost: x\r\nConnection: "
                       f"close\r\nAuthorization: Bearer {bearer}\r\n\r\n")  # fmt: skip
            status, _ = raw(port, request.encode())
            assert status in (401, 404)
    finally:
        agent.stop()
    logged = caplog.text + capsys.readouterr().err
    assert "POST /v1/copies 200" in logged  # the log was captured
    assert "s3cret" not in logged and token not in logged


def test_pool_needs_an_agent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path))
    code, _, err = run_cli(capsys, "pool", "ls")
    assert code == ExitStatus.UNAVAILABLE and "start it (snapctl agent" in err


def test_the_tcp_listener_needs_the_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    token.chmod(0o644)
    options = AgentOptions(listen=("127.0.0.1", 0), token_file=token)
    with pytest.raises(TokenFileError):
        Agent(StateDir(tmp_path), options).start()
    token.chmod(0o600)
    agent = Agent(StateDir(tmp_path), options, spawner_factory=FakeSpawner,  # type: ignore[arg-type]
                  pool_factory=FakePool)  # fmt: skip
    agent.start()
    try:
        port = next(a for a in agent.addresses if isinstance(a, tuple))[1]

        def get(headers: str) -> int:
            return raw(port, f"GET /v1/version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                             f"{headers}\r\n".encode())[0]  # fmt: skip

        assert get("") == 401
        assert get("Authorization: Bearer wrong\r\n") == 401
        assert get(f"Authorization: Bearer {'t' * 32}\r\n") == 200
    finally:
        agent.stop()


def test_listen_without_a_token_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenFileError):
        Agent(StateDir(tmp_path), AgentOptions(listen=("127.0.0.1", 0))).start()
    assert not os.path.exists(tmp_path / "agent.sock")


def test_ps_through_the_agent_imports_neither_click_nor_anything_heavy(
    running_agent: RunningAgent,
) -> None:
    _record(running_agent.state, "one")
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(running_agent.state.root)}
    for args in (["ps"], ["ps", "--json"]):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "snapctl", *args],
                              env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0 and "one" in done.stdout
        imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
        heavy = {name for name in imported if name.split(".")[0] in HEAVY}
        assert heavy == set(), heavy
    # Without an agent the same command takes the full CLI, and says the same.
    local = subprocess.run([sys.executable, "-m", "snapctl", "--no-agent", "ps", "--json"],
                           env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert local.stdout == done.stdout


def test_images_and_inspect_give_the_same_output_either_way(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    root = tmp_path / "images"
    publish_sample(root / "one")
    for args in (
        ["images", "--root", str(root), "--json"],
        ["images", "--root", str(root)],
        ["inspect", str(root / "one"), "--json"],
        ["inspect", str(root / "one"), "--verify", "--json"],
        ["inspect", str(root / "one"), "--brief"],
    ):
        through = run_cli(capsys, *args)
        assert through[0] == 0, through
        assert through == run_cli(capsys, "--no-agent", *args)
    code, _, err = run_cli(capsys, "inspect", str(tmp_path))
    assert code == ExitStatus.VERIFY_FAILED and err.startswith("error: ")
    assert (code, err) == run_cli(capsys, "--no-agent", "inspect", str(tmp_path))[::2]


def test_images_and_inspect_answer_for_the_agent_s_state_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not for the agent process's SNAPCTL_STATE_DIR or SNAPCTL_IMAGE_ROOT: the caller's
    image root comes with the request, and the state is the agent's own."""
    from snapctl.agent.service import AgentService, BadRequestError
    from snapctl.images import load_manifest
    from snapctl.images.store import is_verified

    mine, other = StateDir(tmp_path / "mine"), StateDir(tmp_path / "other")
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(other.root))
    monkeypatch.setenv("SNAPCTL_IMAGE_ROOT", str(other.root / "images"))
    publish_sample(mine.root / "images" / "one")
    publish_sample(other.root / "images" / "two")
    service = AgentService(mine, pool=None, spawner=None, metrics=None)  # type: ignore[arg-type]
    assert [row["path"] for row in service.images(None)] == [str(mine.root / "images" / "one")]
    root = tmp_path / "root"
    publish_sample(root / "three")
    assert [row["path"] for row in service.images(None, str(root))] == [str(root / "three")]
    with pytest.raises(BadRequestError, match="not an absolute path"):
        service.images(None, "relative")

    image = mine.root / "images" / "one"
    assert service.inspect(str(image), verify=True)["verified"] is True
    assert is_verified(image, load_manifest(image), mine.verified)
    assert not other.verified.exists()
    assert service.images(None)[0]["verified"] is True


def test_images_through_the_agent_use_the_caller_s_image_root(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    publish_sample(running_agent.state.root / "images" / "default")
    for args in (["images", "--json"], ["images"]):
        through = run_cli(capsys, *args)
        assert through[0] == 0 and "default" in through[1]
        assert through == run_cli(capsys, "--no-agent", *args)
    publish_sample(tmp_path / "root" / "mine")
    monkeypatch.setenv("SNAPCTL_IMAGE_ROOT", str(tmp_path / "root"))
    for args in (["images", "--json"], ["images"]):
        through = run_cli(capsys, *args)
        assert through[0] == 0 and "mine" in through[1] and "default" not in through[1]
        assert through == run_cli(capsys, "--no-agent", *args)


def test_ctrl_c_while_the_agent_starts_a_copy_stops_it_once_it_started(
    running_agent: RunningAgent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = tmp_path / "image"
    image.mkdir()
    release = running_agent.spawner.release = threading.Event()
    stopped: list[str] = []
    monkeypatch.setattr(
        "snapctl.agent.service.AgentService.stop",
        lambda self, name, timeout_s: stopped.append(name) or {"name": name},
    )
    env = {**os.environ, "SNAPCTL_STATE_DIR": str(running_agent.state.root)}
    process = subprocess.Popen(
        [sys.executable, "-m", "snapctl", "copy", "--image", str(image), "--no-lazy",
         "--detach", "--json"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    until = time.monotonic() + 30
    while not running_agent.spawner.jobs and time.monotonic() < until:
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    threading.Timer(0.5, release.set).start()  # the start ends after the interrupt
    out, err = process.communicate(timeout=60)
    assert process.returncode == ExitStatus.INTERRUPTED, err
    assert out == "" and "interrupted while starting" in err
    assert stopped == ["copy-1"]  # the report's name, stopped once it had started


def test_an_address_in_use_is_a_listen_error_and_undoes_the_start(
    running_agent: RunningAgent, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spawner = FakeSpawner()
        options = AgentOptions(metrics_listen=("127.0.0.1", port))
        agent = Agent(StateDir(tmp_path / "other"), options, spawner_factory=lambda: spawner,  # type: ignore[arg-type,return-value]
                      pool_factory=FakePool)  # fmt: skip
        with pytest.raises(ListenError) as refused:
            agent.start()
    assert (
        refused.value.exit_status == ExitStatus.UNAVAILABLE and str(port) in refused.value.message
    )
    assert spawner.closed and not (tmp_path / "other" / "agent.sock").exists()


def test_a_name_in_use_is_refused_before_a_parked_copy_is_taken(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    image, handle = ready_parked(running_agent, tmp_path)
    held = running_agent.state.reserve_name("web")
    try:
        code, _, err = run_cli(capsys, "copy", "--image", str(image), "--name", "web", "--json")
    finally:
        held.release()
    assert code == ExitStatus.CONFLICT and "web" in err
    assert running_agent.pool.ready == [handle]  # still parked, for the next request


def test_the_token_is_the_first_line_of_its_file(tmp_path: Path) -> None:
    from snapctl.agent.daemon import read_token

    token = tmp_path / "token"
    token.write_text("t" * 32 + "\nsecond line, a comment\n")
    token.chmod(0o600)
    assert read_token(token) == b"t" * 32


def test_a_socket_path_that_is_not_a_socket_is_never_removed(tmp_path: Path) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_text("data")
    agent = Agent(StateDir(tmp_path / "state"), AgentOptions(socket=precious),
                  spawner_factory=FakeSpawner, pool_factory=FakePool)  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(ListenError, match="not a socket"):
        agent.start()
    agent.stop()
    assert precious.read_text() == "data"


def test_a_body_framed_two_ways_is_refused_and_nothing_in_it_is_answered(
    running_agent: RunningAgent,
) -> None:
    """A Content-Length beside a chunked Transfer-Encoding: two readings of one request, the
    classic smuggling; refused, and the connection closed, its body never read as a request."""
    smuggled = b"GET /v1/version HTTP/1.1\r\nHost: x\r\n\r\n"
    request = (b"POST /v1/copies HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
               b"Content-Length: " + str(len(smuggled)).encode() + b"\r\n\r\n"
               + smuggled)  # fmt: skip
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(running_agent.socket))
        sock.sendall(request)
        answers = b""
        while chunk := sock.recv(65536):
            answers += chunk
    assert answers.count(b"HTTP/1.") == 1 and b" 400 " in answers
    assert running_agent.spawner.jobs == []


def test_a_parked_copy_that_cannot_be_used_is_discarded(
    running_agent: RunningAgent, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from snapctl.pool.serve import ParkedCopyUnusableError

    image, handle = ready_parked(running_agent, tmp_path)

    def unusable(handle: ParkedHandle, request: Any, progress: Any) -> dict[str, Any]:
        raise ParkedCopyUnusableError("it does not answer")

    monkeypatch.setattr("snapctl.pool.serve.activate_taken", unusable)
    run_cli(capsys, "copy", "--image", str(image), "--detach", "--json")
    assert running_agent.pool.forgotten == [handle]  # not left parked, holding memory
