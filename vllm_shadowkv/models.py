"""Small Llama-architecture models built locally, for tests, the demo and benchmarks.

Nothing can be downloaded from a model hub here, so every model this project runs is built on
disk: a byte-level tokenizer (every UTF-8 byte is a token, so any text round-trips) and a Llama
checkpoint with GQA and llama3-scaled RoPE that vLLM loads like any other. Builds are cached
under ``$SHADOWKV_MODELS_DIR`` (default ``~/.cache/vllm_shadowkv/models``) keyed by a hash of
the recipe, so a changed recipe never reuses a stale checkpoint.

    python -m vllm_shadowkv.models tiny llama8b-shape     # prints the paths
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
# Enough for the OpenAI chat endpoint: role headers, then the assistant turn is opened.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>: {% endif %}"
)


@dataclass(frozen=True)
class ModelRecipe:
    """Architecture of a locally built Llama model (random weights unless ``weights`` says)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 131072
    rope_theta: float = 500000.0
    rope_scaling: dict = field(
        default_factory=lambda: {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    )
    vocab_size: int = 320
    dtype: str = "bfloat16"
    seed: int = 0

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


RECIPES: dict[str, ModelRecipe] = {
    # Fast on two CPU cores: tests and the demo. GQA group 4 as in Llama-3.1-8B, and a key
    # width (4 x 64) above the paper's default rank 160, so the default settings apply.
    "tiny": ModelRecipe(
        name="tiny", hidden_size=256, num_layers=4, num_heads=16, num_kv_heads=4, head_dim=64,
        intermediate_size=512,
    ),
    # Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128) with few layers
    # and a thin MLP: the KV cache per token and layer is the real model's, for capacity runs.
    "llama8b-shape": ModelRecipe(
        name="llama8b-shape", hidden_size=4096, num_layers=2, num_heads=32, num_kv_heads=8,
        head_dim=128, intermediate_size=1024,
    ),
}


def models_dir() -> Path:
    default = Path.home() / ".cache" / "vllm_shadowkv" / "models"
    return Path(os.environ.get("SHADOWKV_MODELS_DIR", default))


def build_byte_tokenizer():
    """A byte-level tokenizer: token id b is byte b (0-255), then BOS, EOS and PAD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in enumerate(_byte_symbols())}
    for special in (BOS, EOS, PAD):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    _prepend_bos(fast)
    return fast


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte 0-255, the alphabet of ByteLevel."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def _prepend_bos(fast) -> None:
    from tokenizers import processors

    bos_id = fast.convert_tokens_to_ids(BOS)
    fast._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )


def build_model(name: str, root: Path | None = None, force: bool = False) -> Path:
    """Build (or find in the cache) the model ``name`` and return its directory."""
    recipe = RECIPES.get(name)
    if recipe is None:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(RECIPES)}")
    out = (root or models_dir()) / f"{recipe.name}-{recipe.fingerprint()}"
    if (out / "config.json").exists() and not force:
        return out
    return _write_llama(recipe, out)


def _write_llama(recipe: ModelRecipe, out: Path) -> Path:
    import torch
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_byte_tokenizer()
    config = LlamaConfig(
        vocab_size=recipe.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=recipe.rope_theta,
        rope_scaling=dict(recipe.rope_scaling) if recipe.rope_scaling else None,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype=recipe.dtype,
    )
    torch.manual_seed(recipe.seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(getattr(torch, recipe.dtype))
    params = list(model.named_parameters())
    gen = torch.Generator().manual_seed(recipe.seed)
    for pname, param in tqdm(params, desc=f"building {recipe.name}", unit="tensor"):
        with torch.no_grad():
            if pname.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                std = 0.02 if "embed" in pname or "lm_head" in pname else param.shape[-1] ** -0.5
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "recipe.json").write_text(json.dumps(asdict(recipe), indent=2))
    tmp.rename(out)  # atomic: a half-written build is never found in the cache
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=["tiny"], help=f"of {list(RECIPES)}")
    parser.add_argument("--root", type=Path, default=None, help="cache directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    for name in args.names:
        print(build_model(name, args.root, args.force))


if __name__ == "__main__":
    main()
