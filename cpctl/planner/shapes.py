"""The model: a Llama-style decoder's sizes, the presets, and a Hugging Face config.json read as one."""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpctl.errors import CpctlError
from cpctl.planner.units import TORCH_DTYPE_NAMES

# A block's linear projections, by the names transformers' Llama gives them (and peft's
# target_modules takes); the first four are attention's, the others the MLP's.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_PROJECTIONS, MLP_PROJECTIONS = PROJECTIONS[:4], PROJECTIONS[4:]


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder: RMSNorm, rotary GQA attention, SwiGLU MLP, untied or tied head."""

    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int
    tied_embeddings: bool = False
    notes: tuple[str, ...] = ()
    weights_dtype: str | None = None  # bf16, fp16 or fp32 as the checkpoint holds them (config.json's dtype); None: not said

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def projections(self) -> dict[str, tuple[int, int]]:
        """A block's PROJECTIONS: (in_features, out_features) of each."""
        shapes = ((self.dim, self.q_dim), (self.dim, self.kv_dim), (self.dim, self.kv_dim), (self.q_dim, self.dim),
                  (self.dim, self.ffn_dim), (self.dim, self.ffn_dim), (self.ffn_dim, self.dim))
        return dict(zip(PROJECTIONS, shapes, strict=True))

    @property
    def block_params(self) -> int:
        projections = sum(inputs * outputs for inputs, outputs in self.projections.values())
        return projections + 2 * self.dim  # + the two norms

    @property
    def root_params(self) -> int:
        """Embeddings, head (unless tied) and the final norm: FSDP's root module."""
        return self.vocab_size * self.dim * (1 if self.tied_embeddings else 2) + self.dim

    @property
    def params(self) -> int:
        return self.n_layers * self.block_params + self.root_params

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "notes": list(self.notes), "params": self.params}


def _llama(name: str, *, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, ffn: int,
           tied: bool = False) -> ModelShape:
    return ModelShape(name, vocab, dim, layers, heads, kv_heads, ffn, dim // heads, tied)


# scripts/llama.py's presets (tests/test_planner.py checks they agree) and the Llama 3 shapes.
PRESETS: dict[str, ModelShape] = {
    "tiny": _llama("tiny", vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=128),
    "1b": _llama("1b", vocab=32000, dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "llama-3.2-1b": _llama("llama-3.2-1b", vocab=128256, dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192,
                           tied=True),
    "llama-3.2-3b": _llama("llama-3.2-3b", vocab=128256, dim=3072, layers=28, heads=24, kv_heads=8, ffn=8192,
                           tied=True),
    "llama-3.1-8b": _llama("llama-3.1-8b", vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
}

_HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def load_model(spec: str) -> ModelShape:
    """A preset name, or a Hugging Face config.json (or the directory holding one)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.exists() and ("/" in spec or spec.endswith(".json")):
        preset = hub_preset(spec)
        if preset is not None:  # a Hub id whose shape is a preset's: nothing to download
            note = (f"{spec} is not a file here; it has the shape of the preset {preset.name}, used here "
                    "(cpctl plan downloads nothing; for another model pass its config.json)")
            return dataclasses.replace(preset, notes=(*preset.notes, note))
        raise CpctlError(f"--model {spec}: no such file (a Hugging Face config.json, or the directory holding one; "
                         f"cpctl plan downloads nothing) and no preset of that name (presets: {', '.join(PRESETS)})")
    if not path.exists():
        close = difflib.get_close_matches(spec, PRESETS, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise CpctlError(f"--model {spec}: no such preset or file{hint} (presets: {', '.join(PRESETS)}; "
                         "or a Hugging Face config.json)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CpctlError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CpctlError(f"{path}: cannot read it ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(config, dict):
        raise CpctlError(f"{path}: not a Hugging Face config.json (a JSON object was expected)")
    return model_from_hf_config(config, name=str(path))


def hub_preset(spec: str) -> ModelShape | None:
    """The preset a Hugging Face Hub id names (`meta-llama/Llama-3.2-1B`, `...-Instruct`,
    `meta-llama/Meta-Llama-3.1-8B`: the same shapes), else None."""
    name = spec.rstrip("/").rpartition("/")[2].lower().removeprefix("meta-")
    for suffix in ("-instruct", "-hf"):
        name = name.removesuffix(suffix)
    return PRESETS.get(name)


def model_from_hf_config(config: Mapping[str, Any], *, name: str) -> ModelShape:
    text = config.get("text_config")
    if "hidden_size" not in config and isinstance(text, Mapping):  # a multimodal model's language part
        config = text
    missing = [key for key in _HF_REQUIRED if key not in config]
    if missing:
        raise CpctlError(f"{name}: no {missing[0]} in it; cpctl plan reads a decoder LM's config.json "
                         f"({', '.join(_HF_REQUIRED)})")

    def positive(key: str, default: Any = None) -> int:
        value = config.get(key)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CpctlError(f"{name}: {key} must be a positive integer, got {value!r}")
        return value

    heads = positive("num_attention_heads")
    dim = positive("hidden_size")
    notes = []
    if any(key in config for key in ("num_local_experts", "num_experts", "n_routed_experts")):
        notes.append("a mixture of experts: counted as one dense MLP of intermediate_size, experts not counted")
    if config.get("model_type") not in (None, "llama"):
        notes.append(f"model_type {config.get('model_type')}: estimated as a Llama block of its sizes")
    return ModelShape(
        name=str(config.get("_name_or_path") or name), vocab_size=positive("vocab_size"), dim=dim,
        n_layers=positive("num_hidden_layers"), n_heads=heads,
        n_kv_heads=positive("num_key_value_heads", heads),
        ffn_dim=positive("intermediate_size"), head_dim=positive("head_dim", dim // heads),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)), notes=tuple(notes),
        # transformers 5 writes `dtype`, earlier releases `torch_dtype`: what from_pretrained and from_config build in
        weights_dtype=TORCH_DTYPE_NAMES.get(str(config.get("dtype") or config.get("torch_dtype")).removeprefix("torch.")),
    )
