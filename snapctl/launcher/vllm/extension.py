"""The module vLLM's worker imports for ``--worker-extension-cls``, before it loads the model.

Importing it starts recording the first load's digests of the weights vLLM's CPU path packs
(:func:`.worker.start_first_load_recording`), so the capture needs no identity product to state
them. Only vLLM imports this module; everything else imports :mod:`.worker`.
"""

from __future__ import annotations

from snapctl.launcher.vllm.worker import SnapshotWorkerExtension, start_first_load_recording

__all__ = ["SnapshotWorkerExtension"]

start_first_load_recording()
