"""The base of every strict pydantic model snapctl reads or writes (files on disk, control
files, manifests): unknown fields refused, values not coerced, instances immutable."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """``extra="forbid", frozen=True, strict=True``: a file with a field this version does not
    know, or a value of the wrong type, is refused rather than guessed at."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
