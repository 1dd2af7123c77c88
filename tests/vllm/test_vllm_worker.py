"""The worker extension's digests on real vLLM's CPU weight packing, in the vLLM venv.

A recovery hashes each linear weight as vLLM's ``dispatch_cpu_unquantized_gemm`` receives it
(:func:`snapctl.launcher.vllm.worker.recording_packed_weights`); the first load's digests are
taken by running each packed layer on an identity matrix. The two must agree for every shape
vLLM packs (its oneDNN and its small-GEMM kernels), or every rehearsal fails.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.vllm.conftest import VLLM_ENV, RealVllm

pytestmark = pytest.mark.vllm

SCRIPT = r"""
import hashlib, torch
from vllm.model_executor.layers import utils
from snapctl.launcher.vllm.worker import parameter_digests, recording_packed_weights

class Linear(torch.nn.Module):
    def __init__(self, n, k):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k), requires_grad=False)
        self.input_size_per_partition = k

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # oneDNN (768x256, 434x256) and the small-GEMM kernel (8x256) vLLM picks by shape.
        self.qkv, self.head, self.router = Linear(768, 256), Linear(434, 256), Linear(8, 256)
        self.norm = torch.nn.Parameter(torch.randn(256), requires_grad=False)

torch.manual_seed(0)
model = Model()
unpacked = {name: hashlib.sha256(p.detach().numpy().tobytes()).hexdigest()
            for name, p in model.named_parameters()}
original = utils.dispatch_cpu_unquantized_gemm
with recording_packed_weights() as packed:
    for layer in (model.qkv, model.head, model.router):
        utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
assert utils.dispatch_cpu_unquantized_gemm is original, "the recorder left its wrapper"
assert all(layer.weight.numel() == 0 for layer in (model.qkv, model.head, model.router))
assert len(packed) == 3, packed
recorded, identity = parameter_digests(model, packed), parameter_digests(model)
assert recorded == identity == unpacked, (recorded, identity, unpacked)

try:
    with recording_packed_weights():
        raise KeyError("a reload that fails")
except KeyError:
    pass
assert utils.dispatch_cpu_unquantized_gemm is original, "a failed reload left the wrapper"
print("ok", len(recorded))
"""


def test_recorded_and_identity_digests_agree_on_every_packed_shape(vllm: RealVllm) -> None:
    done = subprocess.run(
        [str(vllm.python), "-c", SCRIPT], capture_output=True, text=True, timeout=180,
        env={**os.environ, **VLLM_ENV}, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["ok", "4"]
