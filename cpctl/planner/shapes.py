"""The model: a decoder's sizes (a Llama block and what the other families add to it), the presets,
and a Hugging Face config.json read as one."""

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
# Phi-3's: q, k and v in one projection, gate and up in another (the same weights, fused).
FUSED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer: a Llama block (RMSNorm, rotary GQA attention, gated MLP), untied or
    tied head, and what other families change in it (the fields after `weights_dtype`).

    What changes memory is counted in `terms.py`: biases and experts as parameters, the q/k norms'
    and extra norms' saved tensors, the experts' per-token activations, the softcapped logits.
    Sliding windows change attention's compute, not its memory here: the engine keeps the same
    tensors per token and moves the same K/V whatever the window (`windowed_layers` says how many
    layers attend through one)."""

    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int  # the dense MLP's intermediate size
    head_dim: int
    tied_embeddings: bool = False
    notes: tuple[str, ...] = ()
    weights_dtype: str | None = None  # bf16, fp16 or fp32 as the checkpoint holds them (config.json's dtype); None: not said
    family: str = "llama"  # transformers' model_type
    qkv_bias: bool = False  # biases on q, k and v (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # a bias on the output projection (Llama's attention_bias)
    mlp_bias: bool = False  # biases on the MLP's projections (Llama's mlp_bias)
    qk_norm: bool = False  # an RMSNorm of head_dim over each head of q and of k (Qwen3, Gemma 3)
    block_norms: int = 2  # before attention and before the MLP; Gemma 2/3 also norm each one's output
    fused_projections: bool = False  # qkv_proj and gate_up_proj (Phi-3): FUSED_PROJECTIONS
    window: int | None = None  # the sliding window of the windowed layers
    windowed_layers: int = 0  # layers attending through `window`; the others see the whole causal prefix
    logit_softcap: float | None = None  # tanh(logits / c) * c before the loss (Gemma 2's final_logit_softcapping)
    experts: int = 0  # a mixture of experts: experts per MoE layer (0: every MLP dense)
    experts_per_token: int = 0  # the router's top k
    expert_ffn_dim: int = 0  # each expert's intermediate size
    dense_layers: int = 0  # in a mixture of experts, the layers whose MLP is dense (ffn_dim)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def moe_layers(self) -> int:
        return self.n_layers - self.dense_layers if self.experts else 0

    @property
    def attention_projections(self) -> dict[str, tuple[int, int]]:
        """Attention's linear projections: (in_features, out_features) of each, by transformers' names."""
        if self.fused_projections:
            return {"qkv_proj": (self.dim, self.q_dim + 2 * self.kv_dim), "o_proj": (self.q_dim, self.dim)}
        return dict(zip(ATTENTION_PROJECTIONS, ((self.dim, self.q_dim), (self.dim, self.kv_dim),
                                                (self.dim, self.kv_dim), (self.q_dim, self.dim)), strict=True))

    @property
    def mlp_projections(self) -> dict[str, tuple[int, int]]:
        """The dense MLP's linear projections. A mixture of experts has none: its experts are 3D
        parameters and its router a plain one (transformers 5), none of them linear layers peft targets."""
        if self.experts and not self.dense_layers:
            return {}
        if self.fused_projections:
            return {"gate_up_proj": (self.dim, 2 * self.ffn_dim), "down_proj": (self.ffn_dim, self.dim)}
        return dict(zip(MLP_PROJECTIONS, ((self.dim, self.ffn_dim), (self.dim, self.ffn_dim),
                                          (self.ffn_dim, self.dim)), strict=True))

    @property
    def projections(self) -> dict[str, tuple[int, int]]:
        """A block's linear projections (what LoRA adapts): (in_features, out_features) of each."""
        return {**self.attention_projections, **self.mlp_projections}

    @property
    def attention_params(self) -> int:
        projections = 2 * self.dim * (self.q_dim + self.kv_dim)  # q and o, k and v
        biases = (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + self.dim * self.o_bias
        return projections + biases + 2 * self.head_dim * self.qk_norm

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.dim * self.ffn_dim + (2 * self.ffn_dim + self.dim) * self.mlp_bias

    @property
    def moe_mlp_params(self) -> int:
        """The experts' gate, up and down projections and the router's weight (experts x dim)."""
        return self.experts * (3 * self.dim * self.expert_ffn_dim + self.dim)

    @property
    def block_params(self) -> int:
        """The largest block's parameters: what FSDP gathers to run one."""
        mlp = self.moe_mlp_params if self.experts else self.dense_mlp_params
        return self.attention_params + mlp + self.block_norms * self.dim

    @property
    def layers_params(self) -> int:
        """Every block's parameters (a mixture of experts' dense layers are smaller than its others)."""
        dense = self.attention_params + self.dense_mlp_params + self.block_norms * self.dim
        return self.moe_layers * self.block_params + (self.n_layers - self.moe_layers) * dense

    @property
    def active_expert_params(self) -> int:
        """The experts' weights one token runs through: its top-k experts of each MoE layer."""
        return self.moe_layers * self.experts_per_token * 3 * self.dim * self.expert_ffn_dim

    @property
    def active_mlp_params(self) -> int:
        """Every MLP weight one token runs through: the dense layers' and its experts'."""
        return (self.n_layers - self.moe_layers) * self.dense_mlp_params + self.active_expert_params

    @property
    def active_layers_params(self) -> int:
        """The blocks' parameters one token runs through: its top-k experts of each MoE layer."""
        unused = self.moe_layers * (self.experts - self.experts_per_token) * 3 * self.dim * self.expert_ffn_dim
        return self.layers_params - unused

    @property
    def root_params(self) -> int:
        """Embeddings, head (unless tied) and the final norm: FSDP's root module."""
        return self.vocab_size * self.dim * (1 if self.tied_embeddings else 2) + self.dim

    @property
    def params(self) -> int:
        return self.layers_params + self.root_params

    def features(self) -> list[str]:
        """What this model has beyond a Llama block, in words (the plan's first line)."""
        said = []
        if self.experts:
            dense = f"; {self.dense_layers} dense layers" if self.dense_layers else ""
            said.append(f"{self.experts} experts of {self.expert_ffn_dim}, {self.experts_per_token} per token{dense}")
        if self.fused_projections:
            said.append("fused qkv and gate/up projections")
        if self.qkv_bias or self.o_bias or self.mlp_bias:
            said.append("biases on " + ", ".join(name for name, on in (("q/k/v", self.qkv_bias), ("o", self.o_bias),
                                                                       ("the MLP", self.mlp_bias)) if on))
        if self.qk_norm:
            said.append("q/k norms")
        if self.block_norms != 2:
            said.append(f"{self.block_norms} norms per block")
        if self.windowed_layers:
            said.append(f"sliding window {self.window} on {self.windowed_layers} of {self.n_layers} layers")
        if self.logit_softcap is not None:
            said.append(f"logits soft-capped at {self.logit_softcap:g}")
        return said

    def hf_config(self) -> dict[str, Any]:
        """This shape as transformers' `AutoConfig.for_model(**shape.hf_config())` takes it: a model built
        from it (`AutoModelForCausalLM.from_config`) has `params` parameters (tests/test_families.py).
        Windowed layers keep their count, not necessarily their places."""
        config: dict[str, Any] = {
            "model_type": self.family, "vocab_size": self.vocab_size, "hidden_size": self.dim,
            "intermediate_size": self.ffn_dim, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
            "tie_word_embeddings": self.tied_embeddings}
        family = FAMILIES.get(self.family)
        if family is None:
            raise CpctlError(f"{self.name}: model_type {self.family} is not one cpctl plan knows the blocks of "
                             f"({', '.join(FAMILIES)})")
        if family.attention_bias == "attention_bias":
            config["attention_bias"] = self.qkv_bias
        if family.mlp_bias:
            config["mlp_bias"] = self.mlp_bias
        if self.experts:
            config.update({"num_local_experts": self.experts, "num_experts_per_tok": self.experts_per_token})
            if family.expert_ffn_key != "intermediate_size":
                config[family.expert_ffn_key] = self.expert_ffn_dim
                if self.dense_layers:  # which layers are dense does not change a count
                    config["mlp_only_layers"] = list(range(self.dense_layers))
            else:
                config["intermediate_size"] = self.expert_ffn_dim
        if family.final_softcap:
            config["final_logit_softcapping"] = self.logit_softcap
            config["attn_logit_softcapping"] = None  # cpctl's fused kernels cannot cap scores: trained without it
        config.update(family.window_keys(self))
        return config

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "notes": list(self.notes), "params": self.params}


def _llama(name: str, *, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, ffn: int,
           tied: bool = False) -> ModelShape:
    return ModelShape(name, vocab, dim, layers, heads, kv_heads, ffn, dim // heads, tied)


@dataclass(frozen=True)
class Family:
    """How a transformers model_type's config.json reads as a ModelShape: what its blocks have beyond a
    Llama block, and the values its config class fills in for keys a config.json leaves out (those
    that change a count). tests/test_families.py checks each against transformers' own models."""

    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    attention_bias: str | bool = "attention_bias"  # the key that puts biases on q, k, v and o; True: q, k, v always
    mlp_bias: bool = False  # whether mlp_bias puts biases on the MLP's projections
    qk_norm: bool = False
    block_norms: int = 2
    fused_projections: bool = False
    windows: str = "none"  # which layers attend through sliding_window: none, every, qwen, pattern (see _windowed)
    window_pattern: int = 0  # pattern: every n-th layer sees the whole prefix (sliding_window_pattern, else this)
    final_softcap: bool = False  # reads final_logit_softcapping
    expert_ffn_key: str = "moe_intermediate_size"  # each expert's intermediate size (Mixtral: intermediate_size)

    def window_keys(self, shape: ModelShape) -> dict[str, Any]:
        """The config keys that give `shape.windowed_layers` windowed layers (the inverse of _windowed)."""
        if self.windows == "every":
            return {"sliding_window": shape.window if shape.windowed_layers else None}
        if self.windows == "qwen":
            if not shape.windowed_layers:
                return {"use_sliding_window": False}
            return {"use_sliding_window": True, "sliding_window": shape.window,
                    "max_window_layers": shape.n_layers - shape.windowed_layers}
        if self.windows == "pattern":  # the full-attention layers spread evenly
            full = shape.n_layers - shape.windowed_layers
            kinds = ["full_attention" if (i + 1) * full // shape.n_layers > i * full // shape.n_layers
                     else "sliding_attention" for i in range(shape.n_layers)]
            return {"sliding_window": shape.window or self.defaults.get("sliding_window"), "layer_types": kinds}
        return {}


FAMILIES: dict[str, Family] = {
    "llama": Family(mlp_bias=True),
    "mistral": Family(defaults={"sliding_window": 4096}, attention_bias=False, windows="every"),
    "mixtral": Family(defaults={"num_local_experts": 8, "num_experts_per_tok": 2}, attention_bias=False,
                      windows="every", expert_ffn_key="intermediate_size"),
    "qwen2": Family(attention_bias=True, windows="qwen"),
    "qwen3": Family(defaults={"head_dim": 128}, qk_norm=True, windows="qwen"),
    "qwen3_moe": Family(defaults={"head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                                  "moe_intermediate_size": 768, "decoder_sparse_step": 1},
                        qk_norm=True, windows="qwen"),
    "gemma2": Family(defaults={"head_dim": 256, "tie_word_embeddings": True, "sliding_window": 4096,
                               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
                     block_norms=4, windows="pattern", window_pattern=2, final_softcap=True),
    # Gemma 3's text model: a multimodal config.json's text_config says little more than its sizes
    "gemma3_text": Family(defaults={"vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4,
                                    "head_dim": 256, "tie_word_embeddings": True, "sliding_window": 4096},
                          qk_norm=True, block_norms=4, windows="pattern", window_pattern=6, final_softcap=True),
    "phi3": Family(attention_bias=False, fused_projections=True, windows="every"),
}
_ALIASES = {"gemma3": "gemma3_text"}  # Gemma 3's multimodal model_type, when its text sizes are at the top level
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # transformers' names across families

_HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def _windowed(config: Mapping[str, Any], family: Family, n_layers: int) -> tuple[int | None, int]:
    """(the window, how many layers attend through it): from layer_types where the config lists them
    (transformers 5 writes them), else as the family's config class derives them."""
    window = config.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return None, 0
    kinds = config.get("layer_types")
    if isinstance(kinds, list) and len(kinds) == n_layers:
        count = sum(kind == "sliding_attention" for kind in kinds)
    elif family.windows == "every":
        count = n_layers
    elif family.windows == "qwen":  # use_sliding_window: the layers from max_window_layers on
        first = config.get("max_window_layers")
        count = max(0, n_layers - first) if config.get("use_sliding_window") and isinstance(first, int) else 0
    elif family.windows == "pattern":
        every = config.get("sliding_window_pattern") or family.window_pattern
        count = n_layers - n_layers // every
    else:
        count = 0
    return (window, count) if count else (None, 0)


# Well-known models, as their public config.json files say them (the keys that change a count; those
# a config class fills in are left to it, as there). Read like any config.json: tests/test_families.py
# checks each against transformers' model of that config (on the meta device) and its published size.
_HUB_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
                     "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                     "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 131072,
                     "max_window_layers": 21},
    "qwen2.5-7b": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 131072,
                   "max_window_layers": 28},
    "qwen3-8b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "attention_bias": False, "tie_word_embeddings": False, "use_sliding_window": False,
                 "sliding_window": None, "max_window_layers": 36},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                      "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "norm_topk_prob": True, "attention_bias": False, "tie_word_embeddings": False,
                      "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48},
    "mistral-7b-v0.1": {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                        "sliding_window": 4096, "tie_word_embeddings": False},
    "mistral-7b-v0.3": {"model_type": "mistral", "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                        "sliding_window": None, "tie_word_embeddings": False},
    "mixtral-8x7b-v0.1": {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
                          "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                          "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                          "sliding_window": None, "tie_word_embeddings": False},
    "gemma-2-2b": {"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
                   "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                   "sliding_window": 4096, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma-2-9b": {"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 3584, "intermediate_size": 14336,
                   "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                   "sliding_window": 4096, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma-3-1b": {"model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
                   "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                   "sliding_window": 512, "sliding_window_pattern": 6, "final_logit_softcapping": None},
    "gemma-3-12b": {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 3840,
                    "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
                    "final_logit_softcapping": None},
    "phi-3-mini-4k": {"model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
                      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                      "sliding_window": 2047, "tie_word_embeddings": False},
    "phi-3-mini-128k": {"model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                        "sliding_window": 262144, "tie_word_embeddings": False},
}


# model_types that are encoders unless their config says is_decoder (RoBERTa can be built as one),
# and the heads that make an architecture an encoder's or a causal LM's
_ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
                       "camembert", "mpnet", "modernbert", "ernie", "xlnet", "longformer", "big_bird", "funnel"})
_ENCODER_HEADS = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                  "ForMultipleChoice", "ForPreTraining", "ForNextSentencePrediction")
_CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def model_from_hf_config(config: Mapping[str, Any], *, name: str) -> ModelShape:
    """A Hugging Face config.json (its text model's, for a multimodal one) as a ModelShape: the blocks of
    its model_type (FAMILIES), or a Llama block of its sizes for a model_type cpctl does not know (said in
    the shape's notes)."""
    notes = []
    text = config.get("text_config")
    if "hidden_size" not in config and isinstance(text, Mapping):  # a multimodal model's language part
        if config.get("vision_config") is not None:
            notes.append("its vision encoder (vision_config) is not counted: the language model's memory alone")
        config = text
    model_type = config.get("model_type")
    model_type = _ALIASES.get(model_type, model_type)
    heads = [arch for arch in config.get("architectures") or () if isinstance(arch, str)]
    causal = config.get("is_decoder") or any(arch.endswith(_CAUSAL_HEADS) for arch in heads)
    encoder_heads = bool(heads) and all(arch.endswith(_ENCODER_HEADS) or "Encoder" in arch for arch in heads)
    if not causal and (model_type in _ENCODERS or encoder_heads):
        shown = f"architectures {', '.join(heads)}" if heads else f"model_type {model_type}"
        raise CpctlError(f"{name}: an encoder's config ({shown}), not a decoder LM's; cpctl plans causal language "
                         "models (a ...ForCausalLM)")
    family = FAMILIES.get(model_type or "llama")
    if family is None:
        notes.append(f"model_type {model_type}: estimated as a Llama block of its sizes")
        family = FAMILIES["llama"]
    config = {**family.defaults, **config}  # a key left out has its config class's value; null stays null
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

    heads, dim, layers = positive("num_attention_heads"), positive("hidden_size"), positive("num_hidden_layers")
    ffn = positive("intermediate_size")
    experts = next((config[key] for key in EXPERT_COUNT_KEYS if config.get(key)), 0)
    moe: dict[str, int] = {}
    if experts:
        expert_ffn_key = family.expert_ffn_key if family.expert_ffn_key in config else "intermediate_size"
        dense = set(config.get("mlp_only_layers") or ())
        step = positive("decoder_sparse_step", 1)
        moe = {"experts": positive(next(key for key in EXPERT_COUNT_KEYS if config.get(key))),
               "experts_per_token": positive("num_experts_per_tok"), "expert_ffn_dim": positive(expert_ffn_key),
               "dense_layers": sum(i in dense or (i + 1) % step != 0 for i in range(layers))}
        if any(config.get(key) for key in ("shared_expert_intermediate_size", "n_shared_experts")):
            notes.append("its shared experts are not counted")
    attention_bias = (bool(config.get(family.attention_bias, False)) if isinstance(family.attention_bias, str)
                      else family.attention_bias)
    window, windowed = _windowed(config, family, layers)
    if config.get("attn_logit_softcapping") is not None:
        notes.append(f"attn_logit_softcapping {config['attn_logit_softcapping']:g}: cpctl's engine does not cap "
                     "attention scores (fused kernels cannot); the model trains under cpctl with it set to None")
    return ModelShape(
        name=str(config.get("_name_or_path") or name), vocab_size=positive("vocab_size"), dim=dim,
        n_layers=layers, n_heads=heads, n_kv_heads=positive("num_key_value_heads", heads),
        ffn_dim=ffn, head_dim=positive("head_dim", dim // heads),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)), notes=tuple(notes),
        # transformers 5 writes `dtype`, earlier releases `torch_dtype`: what from_pretrained and from_config build in
        weights_dtype=TORCH_DTYPE_NAMES.get(str(config.get("dtype") or config.get("torch_dtype")).removeprefix("torch.")),
        family=model_type if model_type in FAMILIES else "llama",
        qkv_bias=attention_bias, o_bias=attention_bias and isinstance(family.attention_bias, str),
        mlp_bias=family.mlp_bias and bool(config.get("mlp_bias", False)), qk_norm=family.qk_norm,
        block_norms=family.block_norms, fused_projections=family.fused_projections, window=window,
        windowed_layers=windowed,
        logit_softcap=config.get("final_logit_softcapping") if family.final_softcap else None, **moe,
    )


# scripts/llama.py's presets (tests/test_planner.py checks they agree), the Llama 3 shapes, and the
# other families' well-known sizes.
PRESETS: dict[str, ModelShape] = {
    "tiny": _llama("tiny", vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=128),
    "1b": _llama("1b", vocab=32000, dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "llama-3.2-1b": _llama("llama-3.2-1b", vocab=128256, dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192,
                           tied=True),
    "llama-3.2-3b": _llama("llama-3.2-3b", vocab=128256, dim=3072, layers=28, heads=24, kv_heads=8, ffn=8192,
                           tied=True),
    "llama-3.1-8b": _llama("llama-3.1-8b", vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
    "llama-3.1-70b": _llama("llama-3.1-70b", vocab=128256, dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672),
    **{name: model_from_hf_config(config, name=name) for name, config in _HUB_CONFIGS.items()},
}


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
    """The preset a Hugging Face Hub id names, else None: a preset is named as its Hub repository
    (`Qwen/Qwen3-8B`: qwen3-8b; `meta-llama/Meta-Llama-3.1-8B`: llama-3.1-8b), and the tuned variants
    of a model have its shape (`...-Instruct`, `-it`, `-pt`, `-Base`, `-hf`, wherever in the name:
    `mistralai/Mistral-7B-Instruct-v0.3` is mistral-7b-v0.3)."""
    name = spec.rstrip("/").rpartition("/")[2].lower().removeprefix("meta-")
    words = [word for word in name.split("-") if word not in _VARIANT_WORDS]
    return PRESETS.get("-".join(words))


_VARIANT_WORDS = frozenset({"instruct", "it", "pt", "base", "hf"})  # a Hub name's words that do not change the shape
