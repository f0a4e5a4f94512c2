"""Draft checkpoints: safetensors for tensors, JSON for everything else. Nothing is pickled, so
loading a checkpoint never runs code from it.

A draft folder holds `model.safetensors` (the trainable weights, the frozen lm_head rows and the
draft vocabulary as `draft_ids`) and `config.json` (architecture, vocabulary size, provenance).
A training checkpoint adds each draft's optimizer state and `state.json` (where the run is).
Folders are written under a temporary name and renamed into place. Reading a draft back
(`load_draft`) is the draft registry's, `dspark.drafts`, which knows every kind.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save_file as _save_file
from torch import nn

from dspark.errors import DataError
from dspark.io import sha256_file, write_json

FORMAT = "dspark-draft"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None):
    """safetensors' writer leaves files 0600; a serving engine under another user must read."""
    _save_file(tensors, str(path), metadata=metadata)
    Path(path).chmod(0o644)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise DataError(f"{path}: missing") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable safetensors file ({e})") from None


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: missing") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: malformed JSON") from None


def host_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous copies in host memory (a model may train on a GPU)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


def save_draft(folder: Path, model: nn.Module, draft_ids: torch.Tensor, extra: dict) -> None:
    """Write one draft into `folder` (an existing, empty, temporary folder)."""
    tensors = host_tensors(model.state_dict())
    tensors["draft_ids"] = draft_ids.to(torch.int64).contiguous()
    save_tensors(folder / WEIGHTS, tensors, metadata={"format": FORMAT})
    write_json(
        folder / CONFIG,
        {"format": FORMAT, "format_version": FORMAT_VERSION, "model": model.cfg.to_dict(), **extra},
    )


def load_state(model: nn.Module, tensors: dict[str, torch.Tensor], where: Path) -> None:
    """load_state_dict with one-line errors that name the first bad tensor."""
    own = model.state_dict()
    missing = sorted(own.keys() - tensors.keys())
    extra = sorted(tensors.keys() - own.keys())
    if missing or extra:
        what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise DataError(f"{where}: does not match the model ({what})")
    for name, t in tensors.items():
        if t.shape != own[name].shape:
            raise DataError(
                f"{where}: {name}: shape {list(t.shape)}, model expects {list(own[name].shape)}"
            )
    model.load_state_dict(tensors)


# --- optimizer state --------------------------------------------------------------------------


def optimizer_tensors(opt: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """AdamW state as flat named tensors. `names`: id(param) -> parameter name."""
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                out[f"{names[id(p)]}::{key}"] = value
    return host_tensors(out)


def load_optimizer(
    opt: torch.optim.Optimizer, names: dict[int, str], tensors: dict[str, torch.Tensor], where: Path
) -> None:
    by_name: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, _, field = key.partition("::")
        by_name.setdefault(name, {})[field] = value
    for group in opt.param_groups:
        for p in group["params"]:
            state = by_name.get(names[id(p)])
            if state is None:
                raise DataError(f"{where}: no optimizer state for {names[id(p)]}")
            # AdamW keeps `step` on the host and its moments beside the parameter.
            opt.state[p] = {
                k: v.clone() if k == "step" else v.to(p.device, copy=True) for k, v in state.items()
            }


def save_optimizer(path: Path, opt: torch.optim.Optimizer, names: dict[int, str]) -> None:
    save_tensors(path, optimizer_tensors(opt, names), metadata={"format": FORMAT})


def read_optimizer(path: Path) -> dict[str, torch.Tensor]:
    return load_tensors(path)


def read_state(folder: Path) -> dict:
    return read_json(Path(folder) / "state.json")


def file_digests(folder: Path) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} of every file in `folder`: what a resume verifies."""
    return {
        f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
        for f in sorted(Path(folder).iterdir())
        if f.is_file()
    }


def verify_files(folder: Path, digests: dict[str, dict]) -> None:
    """Raise DataError naming the first file whose size or checksum is not what was written."""
    for name, want in digests.items():
        path = Path(folder) / name
        if not path.is_file():
            raise DataError(f"{path}: missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise DataError(f"{path}: {size} bytes, {want['bytes']} written")
        if sha256_file(path) != want["sha256"]:
            raise DataError(f"{path}: checksum differs from the one written")
