"""The model file's parameter digests, in the names and layout vLLM gives its parameters.

``python -m snapctl.launcher.vllm reference-digests MODEL`` prints ``{name: sha256}`` of each
parameter as read from the checkpoint's safetensors files, with the checkpoint tensors that vLLM
stacks into one parameter (``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``, and so on, per the
model class's ``packed_modules_mapping``) concatenated in that order, and the vocabulary rows
of the embedding and the LM head padded with zeros to vLLM's multiple of 64, as vLLM's loaders
do.
Qualification compares them with what a serving activation reports, so a weight that differs
in memory from the file is found without starting vLLM. Only what a dense, unquantized model
with one rank does is covered; for anything else the digests simply will not match.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from snapctl.launcher.vllm.worker import tensor_sha256

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight")
FALLBACK_PACKED = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}


def packed_modules(model_dir: Path) -> dict[str, list[str]]:
    """How the model class stacks checkpoint modules (from vLLM's registry, no engine)."""
    architectures = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    try:
        from vllm.model_executor.models.registry import ModelRegistry

        for architecture in architectures:
            model_class = ModelRegistry._try_load_model_cls(architecture)
            mapping = getattr(model_class, "packed_modules_mapping", None)
            if mapping:
                return {str(k): [str(v) for v in vs] for k, vs in mapping.items()}
    except Exception:  # an unknown architecture keeps the common Llama-family stacking
        pass
    return FALLBACK_PACKED


def checkpoint_tensors(model_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def reference_digests(model_dir: Path) -> dict[str, str]:
    import torch

    tensors = checkpoint_tensors(model_dir)
    stacked: dict[str, Any] = {}
    consumed: set[str] = set()
    for packed, parts in packed_modules(model_dir).items():
        for name in tensors:
            module, _, leaf = name.rpartition(".")
            if not module.endswith("." + parts[0]):
                continue
            prefix = module[: -len(parts[0])]
            names = [f"{prefix}{part}.{leaf}" for part in parts]
            if all(n in tensors for n in names):
                stacked[f"{prefix}{packed}.{leaf}"] = torch.cat([tensors[n] for n in names])
                consumed.update(names)
    merged = {n: t for n, t in tensors.items() if n not in consumed} | stacked
    for name, tensor in merged.items():
        if name.endswith(VOCAB_TENSORS) and tensor.shape[0] % VOCAB_PADDING:
            rows = VOCAB_PADDING - tensor.shape[0] % VOCAB_PADDING
            merged[name] = torch.cat([tensor, tensor.new_zeros((rows, *tensor.shape[1:]))])
    return {name: tensor_sha256(tensor)[0] for name, tensor in sorted(merged.items())}
