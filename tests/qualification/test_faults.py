"""The fault run: it enters a copy's mount namespace only while the pinned root still runs,
chooses its fault by the image's memory policy, and breaks weights in a process's memory."""

from __future__ import annotations

import array
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from snapctl.errors import SnapctlError
from snapctl.protocol.facts import CaptureFacts
from snapctl.qualification.faults import _nsenter, fault_mode_for
from snapctl.qualification.memfault import MemoryFault, candidate_tensors, inject_memory_fault
from snapctl.supervision.process import PinnedProcess
from tests.images.factories import make_manifest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="nsenter --mount needs root")


def test_nsenter_runs_in_the_live_roots_mount_namespace() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with PinnedProcess(child.pid) as root:
            proc = _nsenter(root, "readlink", "/proc/self/ns/mnt")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == os.readlink(f"/proc/{child.pid}/ns/mnt")
    finally:
        child.kill()
        child.wait()


def test_nsenter_refuses_a_root_that_exited() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    with PinnedProcess(child.pid) as root:
        child.wait()  # reaped: its PID is free for another process

        with pytest.raises(SnapctlError, match=str(child.pid)):
            _nsenter(root, "true")


@pytest.mark.parametrize(
    ("facts", "mode"),
    [
        (None, "changed"),
        (CaptureFacts(memory_policy="reload", reload_digests=True), "changed"),
        (CaptureFacts(memory_policy="reload"), "unreadable"),
        (CaptureFacts(memory_policy="in-image"), "memory"),
    ],
)
def test_the_fault_follows_the_images_memory_policy(facts: CaptureFacts | None, mode: str) -> None:
    assert fault_mode_for(make_manifest({}, capture_facts=facts)) == mode


def _safetensors(path: Path, tensors: dict[str, bytes]) -> None:
    header: dict[str, object] = {}
    offset = 0
    for name, data in tensors.items():
        header[name] = {
            "dtype": "F32",
            "shape": [len(data) // 4],
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values()))


HOLDER = """
import hashlib, sys
with open(sys.argv[1], "rb") as weights:
    weights.seek(int(sys.argv[2]))
    held = bytearray(weights.read())
print("ready", flush=True)
sys.stdin.readline()
print(hashlib.sha256(held).hexdigest(), flush=True)
"""


def _holding(path: Path, offset: int) -> subprocess.Popen[str]:
    """A process holding the bytes of ``path`` from ``offset`` on in its heap, as a server
    holds its weights; it prints their sha256 when a line arrives."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), str(offset)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    return child


def _held_sha256(child: subprocess.Popen[str]) -> str:
    out, _ = child.communicate("go\n", timeout=30)
    return out.strip()


def test_a_memory_fault_reverses_a_weight_found_in_a_processs_memory(tmp_path: Path) -> None:
    weight = array.array("f", range(4096)).tobytes()
    ones = array.array("f", [1.0] * 4096).tobytes()  # everywhere in memory: never a target
    model = tmp_path / "model.safetensors"
    _safetensors(model, {"norm": ones, "weight": weight})
    tensors = candidate_tensors([model])
    assert [tensor.name for tensor in tensors] == ["weight"]
    child = _holding(model, tensors[0].begin)  # the weight and nothing after it
    try:
        fault = MemoryFault()
        inject_memory_fault([child.pid], tensors, fault)
    finally:
        held = _held_sha256(child)
    # Every copy found (freed heap may still hold one) is reversed, each whole.
    assert fault.tensors == ["weight"] and fault.written == len(weight) * len(fault.places)
    assert all(place.startswith(f"{child.pid}:0x") for place in fault.places)
    reversed_weight = array.array("f", reversed(range(4096))).tobytes()
    assert held == hashlib.sha256(reversed_weight).hexdigest()


def test_a_memory_fault_that_finds_no_weight_says_so(tmp_path: Path) -> None:
    model = tmp_path / "model.safetensors"
    _safetensors(model, {"w": os.urandom(8192)})
    child = _holding(model, len(model.read_bytes()))  # holds nothing of the file
    try:
        with pytest.raises(SnapctlError, match="no tensor of the model's weights files was found"):
            inject_memory_fault([child.pid], candidate_tensors([model]), MemoryFault())
    finally:
        _held_sha256(child)
