"""Write a Llama model directory for real vLLM, deterministically and without a download.

Usage: ``python scripts/llama_model.py DIR [--weights-gb GB]`` (run with the vLLM venv's Python:
it needs numpy, safetensors and tokenizers). Without ``--weights-gb`` the tiny model the tests
use: hidden size 256 with 4 heads (head_dim 64: vLLM's CPU attention refuses 16), 2 KV heads,
2 layers, one ``model.safetensors``. With it, a model of real shape with at least that many GB
of float32 weights: below 1.5 GB the widths of a 0.2 B Llama (hidden 1024, 16 heads, 4 KV heads,
MLP 2816), from 1.5 GB TinyLlama-1.1B's (hidden 2048, 32 heads, 4 KV heads, MLP 5632), both
with a 32000-row vocabulary, and as many layers as the size needs, in shards of at most 1 GB
with vLLM's ``model.safetensors.index.json``. Every model has a 512-token ByteLevel BPE
tokenizer trained here on a fixed text; the weights are float32 normals from a seeded
generator. The same DIR is rewritten only when a file differs, so running it again is a no-op.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 512  # the tokenizer's; a model of real shape has more embedding rows
SPECIAL = ["<s>", "</s>"]
SHARD_BYTES = 10**9


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    layers: int
    rows: int | None = None  # embedding rows (None: the tokenizer's vocabulary)

    def params(self, vocab: int) -> int:
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.kv_heads * head_dim * self.hidden
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return 2 * (self.rows or vocab) * self.hidden + self.layers * layer + self.hidden


TINY = Shape(hidden=256, heads=4, kv_heads=2, intermediate=512, layers=2)
SMALL_WIDTHS = Shape(hidden=1024, heads=16, kv_heads=4, intermediate=2816, layers=0, rows=32000)
LARGE_WIDTHS = Shape(hidden=2048, heads=32, kv_heads=4, intermediate=5632, layers=0, rows=32000)


def shape_for(weights_gb: float | None) -> Shape:
    """The tiny shape, or the widths for ``weights_gb`` with enough layers to reach it."""
    if weights_gb is None:
        return TINY
    widths = SMALL_WIDTHS if weights_gb < 1.5 else LARGE_WIDTHS
    empty = widths.params(VOCAB)
    per_layer = Shape(**{**widths.__dict__, "layers": 1}).params(VOCAB) - empty
    layers = max(1, math.ceil((weights_gb * 1e9 / 4 - empty) / per_layer))
    return Shape(**{**widths.__dict__, "layers": layers})


TEXT = (
    "the capital of france is paris once upon a time there was an engine that was cold and "
    "then it was warm hello my name is def main return print request pair says asks streamed "
    "answer in the beginning model weights tokens snapshot restore copy donor image server"
)
WORDS = TEXT.split()


def corpus() -> list[str]:
    rng = np.random.default_rng(1)
    return [" ".join(rng.choice(WORDS, size=12)) + "." for _ in range(2000)]


def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def weights(shape: Shape, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    hidden, head_dim = shape.hidden, shape.hidden // shape.heads
    # Keeps the residual stream's scale about the same at every width.
    scale = 0.08 * math.sqrt(256 / hidden)

    def normal(*dims: int, scale: float = scale) -> np.ndarray:
        return (rng.standard_normal(dims) * scale).astype(np.float32)

    rows = shape.rows or vocab
    tensors = {"model.embed_tokens.weight": normal(rows, hidden, scale=0.5)}
    for i in range(shape.layers):
        prefix = f"model.layers.{i}."
        tensors[prefix + "self_attn.q_proj.weight"] = normal(hidden, hidden)
        tensors[prefix + "self_attn.k_proj.weight"] = normal(shape.kv_heads * head_dim, hidden)
        tensors[prefix + "self_attn.v_proj.weight"] = normal(shape.kv_heads * head_dim, hidden)
        tensors[prefix + "self_attn.o_proj.weight"] = normal(hidden, hidden)
        tensors[prefix + "mlp.gate_proj.weight"] = normal(shape.intermediate, hidden)
        tensors[prefix + "mlp.up_proj.weight"] = normal(shape.intermediate, hidden)
        tensors[prefix + "mlp.down_proj.weight"] = normal(hidden, shape.intermediate)
        tensors[prefix + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        tensors[prefix + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
    tensors["model.norm.weight"] = np.ones(hidden, np.float32)
    tensors["lm_head.weight"] = normal(rows, hidden, scale=0.5)
    return tensors


def config(shape: Shape, vocab: int, bos: int, eos: int) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden // shape.heads,
        "num_hidden_layers": shape.layers,
        "vocab_size": shape.rows or vocab,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": bos,
        "eos_token_id": eos,
    }


def save_shards(tensors: dict[str, np.ndarray], directory: Path) -> None:
    """One ``model.safetensors`` when it fits a shard, else shards and their index."""
    total = sum(t.nbytes for t in tensors.values())
    if total <= SHARD_BYTES:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if size and size + tensor.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2))


def write(directory: Path, weights_gb: float | None = None) -> None:
    shape = shape_for(weights_gb)
    tok = tokenizer()
    vocab = tok.get_vocab_size()
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    directory.parent.mkdir(parents=True, exist_ok=True)
    # Beside the target, so each file moves in by a rename (no copy across filesystems, no
    # gigabytes in a tmpfs /tmp).
    with tempfile.TemporaryDirectory(dir=directory.parent, prefix=f".{directory.name}.") as scratch:
        staged = Path(scratch)
        tok.save(str(staged / "tokenizer.json"))
        (staged / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": "<s>",
                    "eos_token": "</s>",
                    "model_max_length": 512,
                    "clean_up_tokenization_spaces": False,
                },
                indent=2,
            )
        )
        (staged / "config.json").write_text(json.dumps(config(shape, vocab, bos, eos), indent=2))
        save_shards(weights(shape, vocab), staged)
        directory.mkdir(parents=True, exist_ok=True)
        # config.json last: its presence is what says the model is whole.
        for made in sorted(
            staged.iterdir(), key=lambda path: (path.name == "config.json", path.name)
        ):
            target = directory / made.name
            if not target.exists() or _sha256(target) != _sha256(made):
                made.chmod(0o644)
                made.replace(target)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument(
        "--weights-gb", type=float, help="at least this many GB of weights (default: tiny)"
    )
    args = parser.parse_args()
    if args.weights_gb is not None and not args.weights_gb > 0:
        parser.error("--weights-gb must be positive")
    write(args.directory, args.weights_gb)


if __name__ == "__main__":
    main()
