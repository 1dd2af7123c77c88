"""Worker-side methods, added to vLLM's worker with ``--worker-extension-cls``.

They run in ``VLLM::Worker``, where the weights are, and return only small results (hex
digests) over the engine's RPC. A digest is of a parameter as the model computes with it: vLLM's
CPU build packs linear weights into kernel handles and leaves an empty ``weight`` parameter, so
for such a layer the digest is of the weight the handle applies (the layer run on an identity
matrix, exact in its dtype), in the parameter's layout. :mod:`.reference` computes the same
digests from the checkpoint files.

The first load and a reload (under the ``reload`` policy with digests) hash each linear weight
just before vLLM packs it instead (:func:`recording_packed_weights`; for the first load from
the moment vLLM imports the extension, :mod:`.extension`): the identity product costs as much as
a forward pass over ``in_features`` tokens per layer, too much for a capture or a copy of a large
model on CPU. It stays for the debug route, which must read the weights as the kernels hold them
now (``tests/vllm/test_vllm_worker.py`` checks that both ways agree).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

EXTENSION = "snapctl.launcher.vllm.extension.SnapshotWorkerExtension"
# Set by the bridge in startup mode: only then does a worker record its first load's digests.
RECORD_LOAD_ENV = "SNAPCTL_RECORD_LOAD_DIGESTS"


def tensor_sha256(tensor: Any) -> tuple[str, int]:
    import torch

    raw = tensor.detach().contiguous().cpu().reshape(-1).view(dtype=torch.uint8).numpy()
    return hashlib.sha256(memoryview(raw)).hexdigest(), int(raw.nbytes)


def drop_precompiled_headers(header_dir: Path, temp_dir: Path) -> int:
    """Remove the compiled headers (``*.gch``) from ``header_dir`` if it is inside ``temp_dir``;
    the bytes removed.

    Torch inductor precompiles its C++ prefix header for the CPU kernels it builds at start, a
    large file in its cache under the temporary directory (docs/vllm.md). In the sandbox that is the
    activation's private tmpfs, which CRIU saves as a gzipped tarball and unpacks again in every
    restore, plain or lazy, so the file cost every copy most of its restore. It is only a cache:
    gcc includes the header itself where its ``.gch`` is missing, so a kernel compiled after a
    restore is slower to build, never different. The header and the locks stay.
    """
    if not header_dir.resolve().is_relative_to(temp_dir.resolve()):
        return 0  # a shared or configured cache: not ours to clear
    removed = 0
    for compiled in header_dir.glob("*.gch"):
        try:
            size = compiled.stat().st_size
            compiled.unlink()
        except FileNotFoundError:
            continue
        removed += size
    return removed


# prctl(PR_SET_MEMORY_MERGE): every present and future mapping of the process may be merged by
# KSM (Linux 6.4 and later).
PR_SET_MEMORY_MERGE = 67


def share_identical_pages() -> bool:
    """Mark this process's memory mergeable by KSM, before a capture: CRIU keeps the mark on
    every mapping, so the copies restored from the image share the pages they never write (the
    weights) once the host runs ``ksmd``. False where the kernel refuses."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) == 0)


@contextmanager
def recording_packed_weights() -> Iterator[dict[Any, str]]:
    """While vLLM (re)loads weights: the sha256 of each 2-D weight that
    ``dispatch_cpu_unquantized_gemm`` is to empty, by its layer, taken before it packs it.
    Both of its callers (linear and embedding layers) import it from its module at each call."""
    stop, recorded = start_recording_packed_weights()
    try:
        yield recorded
    finally:
        stop()


def start_recording_packed_weights() -> tuple[Callable[[], None], dict[Any, str]]:
    """:func:`recording_packed_weights` without a ``with``: the function that stops it, and
    the digests recorded until then."""
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    recorded: dict[Any, str] = {}

    def recording(layer: Any, remove_weight: bool) -> None:
        weight = layer.weight
        if remove_weight and not weight.is_meta and weight.ndim == 2:
            recorded[layer] = tensor_sha256(weight)[0]
        original(layer, remove_weight)

    def stop() -> None:
        utils.dispatch_cpu_unquantized_gemm = original

    utils.dispatch_cpu_unquantized_gemm = recording
    return stop, recorded


# The first load's recording (started by :mod:`.extension`, taken by the first digest read).
_first_load: tuple[Callable[[], None], dict[Any, str]] | None = None


def start_first_load_recording() -> None:
    """Record from now on; only in a worker of the bridge's startup mode (plain serving never
    reads them), inside a process already running vLLM (its worker imports the extension), so
    importing the extension anywhere else loads nothing."""
    global _first_load
    if _first_load is None and "vllm" in sys.modules and os.environ.get(RECORD_LOAD_ENV) == "1":
        _first_load = start_recording_packed_weights()


def take_first_load_recording() -> dict[Any, str]:
    """What the first load recorded, once; the recording stops (later reloads record their
    own)."""
    global _first_load
    if _first_load is None:
        return {}
    stop, recorded = _first_load
    stop()
    _first_load = None
    return recorded


def parameter_digests(model: Any, packed: Mapping[Any, str] | None = None) -> dict[str, str]:
    """sha256 of every named parameter, by name; an emptied linear weight's is of the weight
    its kernel holds: from ``packed`` (by layer, :func:`recording_packed_weights`) where it is
    there, else the layer run on an identity matrix."""
    import torch

    packed = packed or {}
    digests: dict[str, str] = {}
    for name, parameter in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        tensor = parameter
        if parameter.numel() == 0 and leaf == "weight":
            module = model.get_submodule(module_name)
            if module in packed:
                digests[name] = packed[module]
                continue
            linear = getattr(module, "cpu_linear", None)
            size = getattr(module, "input_size_per_partition", None)
            if linear is not None and size:
                with torch.inference_mode():
                    identity = torch.eye(int(size), dtype=parameter.dtype)
                    # x @ W.T with x = I is W.T, exactly: one product by 1 per element.
                    tensor = linear(identity, parameter, None).t()
        digests[name] = tensor_sha256(tensor)[0]
    return digests


class SnapshotWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    model_runner: Any
    reload_weights: Callable[[], None]  # annotations only: vLLM refuses names its worker has
    _snapctl_loaded_digests: dict[str, str]

    def snapctl_parameter_digests(self) -> dict[str, str]:
        """sha256 of every named parameter, by name, as the kernels hold them now."""
        return parameter_digests(self.model_runner.get_model())

    def snapctl_loaded_digests(self) -> dict[str, str]:
        """sha256 of every named parameter, by name, as the first load packed them (asked
        once, before the capture)."""
        model = self.model_runner.get_model()
        if not hasattr(self, "_snapctl_loaded_digests"):
            self._snapctl_loaded_digests = parameter_digests(model, take_first_load_recording())
        return self._snapctl_loaded_digests

    def snapctl_reload_weights(self, digests: bool = True) -> dict[str, str]:
        """vLLM's ``reload_weights`` (from the weights files), then, with ``digests``, the
        reloaded parameters' digests, in one call."""
        if not digests:
            self.reload_weights()
            return {}
        with recording_packed_weights() as packed:
            self.reload_weights()
        return parameter_digests(self.model_runner.get_model(), packed)

    def snapctl_share_memory(self) -> bool:
        """Before an in-image capture: :func:`share_identical_pages` in the worker."""
        return share_identical_pages()

    def snapctl_drop_compile_caches(self) -> int:
        """Before a capture: :func:`drop_precompiled_headers` for torch inductor's headers."""
        from torch._inductor import codecache

        header_dir = getattr(codecache, "_HEADER_DIR", None)
        if header_dir is None or not os.path.isdir(header_dir):
            return 0
        return drop_precompiled_headers(Path(header_dir), Path(tempfile.gettempdir()))

    def snapctl_retained_digest(self) -> dict[str, Any]:
        """sha256 over the model's buffers (rotary tables and the like): memory computed at
        start and kept across a capture, never reloaded, so a copy's must equal the donor's."""
        digest = hashlib.sha256()
        total = 0
        model = self.model_runner.get_model()
        for name, buffer in sorted(model.named_buffers(), key=lambda item: item[0]):
            hexdigest, size = tensor_sha256(buffer)
            digest.update(f"{name}:{hexdigest}\n".encode())
            total += size
        return {"sha256": digest.hexdigest(), "mb": round(total / 2**20, 3), "device": "cpu"}
