"""What a snapctl-aware server states about its capture, beside the v1 control files.

The v1 protocol says nothing about how a server keeps its weights through a capture. snapctl's
launcher states it in one file, ``capture-facts.json``, written once before
``capture-ready.json`` to the path snapctl names in :data:`FACTS_ENV` (never into the control
directory, whose six files stay exactly v1's). A server that does not know the variable (vLLM's
own startup mode) writes nothing, and the image records no facts.

The memory policy is what a copy's recovery costs per GB of weights:

- ``in-image``: the weights stay in memory through the capture, so they come back with the
  image's pages (whose sha256 the image verifies); a recovery reads no weights file and hashes
  nothing. vLLM's CPU platform chooses it; CUDA with ``--native cuda-checkpoint`` is one too,
  given as an option.
- ``reload``: the weights are released before the capture (vLLM's ``sleep(level=2)``) and read
  from their files again in every recovery; ``reload_digests`` adds a sha256 of every reloaded
  parameter, compared with the first load's.

``parameter_digests`` are the first load's, by parameter name: ``snapctl qualify`` compares
every activation's with them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from snapctl.models import StrictModel
from snapctl.protocol.atomic import read_json_bounded, validate_model, write_json_atomic

MemoryPolicy = Literal["in-image", "reload"]
ParameterName = Annotated[str, Field(min_length=1, max_length=512)]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
MEMORY_POLICIES: tuple[MemoryPolicy, ...] = ("in-image", "reload")

# The path the server writes its facts to (set by snapctl in the server's environment).
FACTS_ENV = "SNAPCTL_CAPTURE_FACTS"
FACTS_FILE = "capture-facts.json"
# Room for a digest of every parameter of a very large model, far below a manifest's bound.
MAX_FACTS_BYTES = 4 << 20


class CaptureFacts(StrictModel):
    """``capture-facts.json``: the memory policy and the first load's parameter digests."""

    version: Literal[1] = 1
    memory_policy: MemoryPolicy
    reload_digests: bool = False
    parameter_digests: dict[ParameterName, Sha256Hex] = {}

    @model_validator(mode="after")
    def _digests_need_a_reload(self) -> CaptureFacts:
        if self.reload_digests and self.memory_policy != "reload":
            raise ValueError("reload_digests needs the reload policy")
        return self


def facts_path_from_env() -> Path | None:
    """Where this server writes its facts, or None when snapctl asked for none."""
    value = os.environ.get(FACTS_ENV)
    return Path(value) if value and os.path.isabs(value) else None


def write_facts(path: Path, facts: CaptureFacts) -> None:
    write_json_atomic(path, facts, overwrite=True, max_bytes=MAX_FACTS_BYTES)


def read_facts(path: Path) -> CaptureFacts | None:
    """The facts at ``path``, or None where the server wrote none."""
    payload = read_json_bounded(path, max_bytes=MAX_FACTS_BYTES)
    return None if payload is None else validate_model(path, payload, CaptureFacts)
