"""The fault run's memory fault, for images whose weights come back with their pages.

Under the ``in-image`` memory policy a recovery reads no weights file, so a changed file cannot
be its fault. What stands for it is a changed weight in the restored copy's memory: tensors of
the model's safetensors files are found in the copy's processes by their bytes and overwritten
in reversed element order through ``/proc/PID/mem``, in that copy only, before its activation.
Its recovery canary must then fail. Tensors the server keeps in another layout (packed kernel
weights) are not found; the embedding tables a server looks tokens up in are, so those are
looked for first.
"""

from __future__ import annotations

import array
import json
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from snapctl.errors import SnapctlError

# Element sizes of the safetensors dtypes a reversal must keep whole.
_ELEMENT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "U8": 1}
_TYPECODES = {1: "B", 2: "H", 4: "I", 8: "Q"}
NEEDLE_BYTES = 64
MIN_TENSOR_BYTES = 4096
MAX_TENSORS = 8
# Looked for first: servers keep them as the file has them (vLLM packs its linear layers).
_AS_STORED = ("embed", "lm_head", "wte", "tok_embeddings")
# The most a search reads of one process's memory: a copy that maps more is refused.
MAX_SCAN_BYTES = 256 << 30
_CHUNK = 16 << 20
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors file: where its bytes are, and a piece to look for."""

    file: Path
    name: str
    element: int
    begin: int  # absolute offset in the file
    size: int
    needle_at: int  # offset of the needle inside the tensor

    def read(self) -> bytes:
        with open(self.file, "rb") as handle:
            handle.seek(self.begin)
            return handle.read(self.size)


@dataclass
class MemoryFault:
    """What the injection did: the tensors overwritten, where, and how many bytes."""

    tensors: list[str] = field(default_factory=list)
    places: list[str] = field(default_factory=list)  # "PID:0xADDRESS"
    written: int = 0


def candidate_tensors(files: Iterable[Path], limit: int = MAX_TENSORS) -> list[Tensor]:
    """At most ``limit`` tensors of ``files`` whose middle is not one repeated element (a gain
    of ones is everywhere in memory): embedding tables first, then the largest."""
    found: list[Tensor] = []
    for path in files:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > _MAX_HEADER:
                raise SnapctlError(f"{path}: safetensors header too large", path=path)
            header = json.loads(handle.read(length))
            start = 8 + length
            for name, info in header.items():
                if name == "__metadata__" or info.get("dtype") not in _ELEMENT_BYTES:
                    continue
                begin, end = info["data_offsets"]
                element = _ELEMENT_BYTES[info["dtype"]]
                if end - begin < MIN_TENSOR_BYTES:
                    continue
                middle = (end - begin) // 2 // element * element
                handle.seek(start + begin + middle)
                needle = handle.read(NEEDLE_BYTES)
                if needle == needle[:element] * (NEEDLE_BYTES // element):
                    continue
                found.append(Tensor(path, name, element, start + begin, end - begin, middle))
    found.sort(key=lambda tensor: (not any(n in tensor.name for n in _AS_STORED), -tensor.size))
    return found[:limit]


def _writable_regions(pid: int) -> list[tuple[int, int]]:
    """The private writable mappings of ``pid`` (heap and anonymous memory); refused past
    :data:`MAX_SCAN_BYTES` (a process that reserved more than any model would be a search
    without end)."""
    regions = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            perms = fields[1]
            name = fields[5] if len(fields) > 5 else ""
            if perms[:2] != "rw" or perms[3] != "p" or name in ("[vvar]", "[vsyscall]"):
                continue
            low, high = (int(part, 16) for part in fields[0].split("-"))
            regions.append((low, high))
    total = sum(high - low for low, high in regions)
    if total > MAX_SCAN_BYTES:
        raise SnapctlError(
            f"process {pid} maps {total / 2**30:.0f} GiB of writable memory, more than a memory "
            f"fault searches ({MAX_SCAN_BYTES / 2**30:.0f} GiB)"
        )
    return regions


def _find(mem: int, region: tuple[int, int], needle: bytes) -> Iterator[int]:
    low, high = region
    overlap = len(needle) - 1
    address = low
    while address < high:
        size = min(_CHUNK, high - address)
        try:
            chunk = os.pread(mem, size + overlap if address + size < high else size, address)
        except OSError:
            return  # unreadable (a guard page, a mapping that went away)
        at = chunk.find(needle)
        while at != -1:
            yield address + at
            at = chunk.find(needle, at + 1)
        address += size


def reversed_elements(data: bytes, element: int) -> bytes:
    """``data`` with its ``element``-byte elements in reverse order."""
    elements = array.array(_TYPECODES[element], data)
    elements.reverse()
    return elements.tobytes()


def inject_memory_fault(pids: Iterable[int], tensors: Iterable[Tensor], fault: MemoryFault) -> None:
    """Overwrite every copy of ``tensors`` found in ``pids``' memory with its elements in
    reverse order, recording it in ``fault``; raise when none was found (the fault would test
    nothing)."""
    pids = list(pids)
    for tensor in tensors:
        data = tensor.read()
        needle = data[tensor.needle_at : tensor.needle_at + NEEDLE_BYTES]
        replacement: bytes | None = None
        for pid in pids:
            mem = os.open(f"/proc/{pid}/mem", os.O_RDWR | os.O_CLOEXEC)
            try:
                for region in _writable_regions(pid):
                    for address in list(_find(mem, region, needle)):
                        start = address - tensor.needle_at
                        if start < region[0] or os.pread(mem, tensor.size, start) != data:
                            continue
                        if replacement is None:
                            replacement = reversed_elements(data, tensor.element)
                        fault.written += os.pwrite(mem, replacement, start)
                        fault.places.append(f"{pid}:{start:#x}")
                        if tensor.name not in fault.tensors:
                            fault.tensors.append(tensor.name)
            finally:
                os.close(mem)
    if not fault.tensors:
        raise SnapctlError(
            "no tensor of the model's weights files was found in the copy's memory, so a memory "
            "fault cannot be injected (the server keeps every weight in another layout); "
            "use --fault unreadable with a reload-policy image"
        )
