"""Worker-side methods, added to vLLM's worker with ``--worker-extension-cls``.

They run in ``VLLM::Worker``, where the weights are, and return only small results (hex
digests) over the engine's RPC. A digest is of a parameter as the model computes with it: vLLM's
CPU build packs linear weights into kernel handles and leaves an empty ``weight`` parameter, so
for such a layer the digest is of the weight the handle applies (the layer run on an identity
matrix, exact in its dtype), in the parameter's layout. :mod:`.reference` computes the same
digests from the checkpoint files.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EXTENSION = "snapctl.launcher.vllm.worker.SnapshotWorkerExtension"


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


def effective_parameters(model: Any) -> Iterator[tuple[str, Any]]:
    """Every named parameter; an emptied linear weight replaced by the weight its kernel holds."""
    import torch

    for name, parameter in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        if parameter.numel() == 0 and leaf == "weight":
            module = model.get_submodule(module_name)
            linear = getattr(module, "cpu_linear", None)
            size = getattr(module, "input_size_per_partition", None)
            if linear is not None and size:
                with torch.inference_mode():
                    identity = torch.eye(int(size), dtype=parameter.dtype)
                    # x @ W.T with x = I is W.T, exactly: one product by 1 per element.
                    yield name, linear(identity, parameter, None).t()
                continue
        yield name, parameter


class SnapshotWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    model_runner: Any

    def snapctl_parameter_digests(self) -> dict[str, str]:
        """sha256 of every named parameter, by name."""
        model = self.model_runner.get_model()
        return {name: tensor_sha256(t)[0] for name, t in effective_parameters(model)}

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
