"""Write a tiny Llama model directory for real vLLM, deterministically and without a download.

Usage: ``python scripts/tiny_llama.py DIR`` (run with the vLLM venv's Python: it needs numpy,
safetensors and tokenizers). Hidden size 256 with 4 heads (head_dim 64: vLLM's CPU attention
refuses 16), 2 KV heads, 2 layers, a 512-token ByteLevel BPE tokenizer trained here on a fixed
text; the weights are float32 normals from a seeded generator. The same DIR is rewritten only
when a file differs, so running it again is a no-op.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HIDDEN = 256
HEADS = 4
KV_HEADS = 2
LAYERS = 2
INTERMEDIATE = 512
VOCAB = 512
SPECIAL = ["<s>", "</s>"]

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


def weights(vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS

    def normal(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(vocab, HIDDEN, scale=0.5)}
    for i in range(LAYERS):
        prefix = f"model.layers.{i}."
        tensors[prefix + "self_attn.q_proj.weight"] = normal(HIDDEN, HIDDEN)
        tensors[prefix + "self_attn.k_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN)
        tensors[prefix + "self_attn.v_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN)
        tensors[prefix + "self_attn.o_proj.weight"] = normal(HIDDEN, HIDDEN)
        tensors[prefix + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        tensors[prefix + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        tensors[prefix + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
        tensors[prefix + "input_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        tensors[prefix + "post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float32)
    tensors["model.norm.weight"] = np.ones(HIDDEN, np.float32)
    tensors["lm_head.weight"] = normal(vocab, HIDDEN, scale=0.5)
    return tensors


def config(vocab: int, bos: int, eos: int) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS,
        "num_hidden_layers": LAYERS,
        "vocab_size": vocab,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": bos,
        "eos_token_id": eos,
    }


def write(directory: Path) -> None:
    tok = tokenizer()
    vocab = tok.get_vocab_size()
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    with tempfile.TemporaryDirectory() as scratch:
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
        (staged / "config.json").write_text(json.dumps(config(vocab, bos, eos), indent=2))
        save_file(weights(vocab), str(staged / "model.safetensors"), metadata={"format": "pt"})
        directory.mkdir(parents=True, exist_ok=True)
        for made in sorted(staged.iterdir()):
            target = directory / made.name
            if not target.exists() or _sha256(target) != _sha256(made):
                made.chmod(0o644)
                made.replace(target)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_llama.py DIR")
    write(Path(sys.argv[1]))
