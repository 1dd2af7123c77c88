"""Real vLLM for the ``vllm`` marker: its venv and the tiny model made by ``scripts/setup --vllm``.

Tests marked ``vllm`` skip where that set-up is absent, except under CI, where they fail
(``scripts/test`` runs ``scripts/setup --vllm``, so a skip there would hide a broken set-up).
They are also ``criu`` tests: root and CRIU are required as for those.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import found_or_fail, skip_unless_found

ROOT = Path(__file__).resolve().parents[2]
# The server's environment: offline, no usage reports. (The KV cache is sized by an option, not
# VLLM_CPU_KVCACHE_SPACE, whose least value, 1 GiB, would be most of the image.)
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
# How a capture gives the server those (it gets only what --env names, and VLLM_*).
VLLM_ENV_OPTIONS = tuple(arg for name in VLLM_ENV for arg in ("--env", name))

KV_CACHE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class RealVllm:
    python: Path
    model: Path

    def serve_command(self, *extra: str) -> list[str]:
        return [
            str(self.python), "-m", "snapctl.launcher.vllm", "serve", str(self.model),
            "--dtype", "float32", "--max-model-len", "256",
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *extra,
        ]  # fmt: skip


def real_vllm() -> tuple[RealVllm | None, str]:
    venv = Path(os.environ.get("SNAPCTL_VLLM_VENV", ROOT / ".venv-vllm"))
    model = Path(os.environ.get("SNAPCTL_VLLM_MODEL", ROOT / ".models" / "tiny-llama"))
    python = venv / "bin" / "python"
    if not python.exists():
        return None, f"needs the vLLM venv {venv} (scripts/setup --vllm)"
    if not (model / "model.safetensors").exists():
        return None, f"needs the tiny model {model} (scripts/setup --vllm)"
    return RealVllm(python, model), ""


def pytest_runtest_setup(item: pytest.Item) -> None:
    skip_unless_found(item, "vllm", real_vllm)


@pytest.fixture(scope="session")
def vllm() -> RealVllm:
    return found_or_fail("the vllm fixture", "vllm", real_vllm)


# A model of real shape: at least half a GB of float32 weights (scripts/llama_model.py).
REAL_SHAPE_GB = "0.5"


@pytest.fixture(scope="session")
def real_shape_vllm(vllm: RealVllm) -> RealVllm:
    """The same vLLM serving a Llama of real shape, written once into the checkout's models
    directory (the same bytes every time; a few seconds)."""
    model = ROOT / ".models" / f"llama-{REAL_SHAPE_GB}gb"
    if not (model / "config.json").exists():
        subprocess.run(
            [str(vllm.python), str(ROOT / "scripts" / "llama_model.py"), str(model),
             "--weights-gb", REAL_SHAPE_GB], check=True, timeout=600,
        )  # fmt: skip
    return RealVllm(vllm.python, model)


@pytest.fixture(scope="module", params=["tiny", "real-shape"])
def served(request: pytest.FixtureRequest) -> RealVllm:
    """The tiny model, then one of real shape: a module's tests run for both."""
    name = "vllm" if request.param == "tiny" else "real_shape_vllm"
    served: RealVllm = request.getfixturevalue(name)
    return served
