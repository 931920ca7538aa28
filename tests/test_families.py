"""The model families `cpctl plan` counts beyond Llama (planner/shapes.py's FAMILIES): Qwen2/2.5, Qwen3,
Qwen3-MoE, Mistral, Mixtral, Gemma 2, Gemma 3, Phi-3, checked against transformers itself.

* Parameters: a tiny model of each family, and each preset's real size built on the meta device,
  have the planner's count, to the parameter (and the published sizes, to their rounding).
* Activations: what a block's MLP (its experts, for a mixture of experts) and q/k norms save for
  backward, measured on CPU with autograd's saved-tensor hooks, is the planner's per-token count.
* A config.json of each reads without the "estimated as a Llama block" note, the same whether it
  comes from a file or from transformers' config (`config.to_dict()`, what the runtime reads).
* A bf16 config.json is planned as the runtime trains it: fp32 master weights by default (the
  runtime's own upcast_trainable makes the bytes counted), bf16 with master_weights keep.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cpctl import planner
from cpctl.errors import CpctlError
from cpctl.planner import PRESETS, Setup
from cpctl.planner.shapes import _HUB_CONFIGS, FAMILIES
from cpctl.planner.terms import Sizes, _mlp_intermediates_per_token, loss, qk_norm_saved_per_token

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

K = 1024
# Small enough to build in milliseconds; every projection a different shape (GQA, head_dim x heads != hidden).
TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2}
FAMILY_CONFIGS = {
    "llama": {"attention_bias": True, "mlp_bias": True},
    "qwen2": {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1},
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "mlp_only_layers": [1]},
    "mistral": {"sliding_window": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gemma2": {"sliding_window": 32},
    "gemma3_text": {"sliding_window": 32, "sliding_window_pattern": 3},
    "phi3": {"num_key_value_heads": 4, "sliding_window": 32},  # Phi-3 fuses q/k/v: no GQA in its released sizes
}


def tiny_config(family: str):
    return transformers.AutoConfig.for_model(family, **{**TINY, **FAMILY_CONFIGS[family]})


def meta_params(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_every_family_is_tested() -> None:
    assert set(FAMILY_CONFIGS) == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_a_tiny_model_has_the_planners_parameter_count(family: str) -> None:
    config = tiny_config(family)
    model = transformers.AutoModelForCausalLM.from_config(config)
    shape = planner.model_from_hf_config(config.to_dict(), name=family)
    assert shape.family == family and not any("Llama block" in note for note in shape.notes)
    assert shape.params == sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    assert (max(blocks), sum(blocks)) == (shape.block_params, shape.layers_params)


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_a_config_json_reads_as_transformers_config_of_it(family: str) -> None:
    """The runtime reads `model.config.to_dict()` (runtime/checkpoint_levels.py), `cpctl plan` the file:
    the same shape, and a shape written back as a config (ModelShape.hf_config) is that shape again."""
    raw = {"model_type": family, **TINY, **FAMILY_CONFIGS[family]}
    from_file = planner.model_from_hf_config(raw, name="x")
    assert planner.model_from_hf_config(tiny_config(family).to_dict(), name="x") == from_file
    written_back = planner.model_from_hf_config(from_file.hf_config(), name="x")
    assert written_back == dataclasses.replace(from_file, notes=written_back.notes)  # Gemma 2: attention uncapped


@pytest.mark.parametrize("name", _HUB_CONFIGS)
def test_a_presets_real_size_has_the_planners_parameter_count(name: str) -> None:
    """Built on the meta device from the preset's config.json (as transformers reads it) and from the
    shape written back as a config: the planner's count, to the parameter."""
    shape = PRESETS[name]
    assert meta_params(transformers.AutoConfig.for_model(**_HUB_CONFIGS[name])) == shape.params
    assert meta_params(transformers.AutoConfig.for_model(**shape.hf_config())) == shape.params


# The model cards' sizes (billions, to their last digit, rounded or cut): total, and for a mixture of experts,
# active per token.
PUBLISHED = {
    "qwen2.5-1.5b": 1.54, "qwen2.5-7b": 7.61, "qwen3-8b": 8.2, "qwen3-30b-a3b": (30.5, 3.3), "mistral-7b-v0.1": 7.24,
    "mixtral-8x7b-v0.1": (46.7, 12.9), "gemma-2-2b": 2.61, "gemma-2-9b": 9.24, "gemma-3-1b": 1.0,
    "phi-3-mini-4k": 3.8,
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_presets_have_their_published_sizes(name: str) -> None:
    shape = PRESETS[name]
    total, active = PUBLISHED[name] if isinstance(PUBLISHED[name], tuple) else (PUBLISHED[name], None)
    digit = 10.0 ** -len(str(total).partition(".")[2])
    assert abs(shape.params / 1e9 - total) < digit
    if active is not None:
        assert abs((shape.active_layers_params + shape.root_params) / 1e9 - active) < 0.1


def test_sliding_windows_are_counted_as_transformers_places_them() -> None:
    for family in FAMILY_CONFIGS:
        config = tiny_config(family)
        kinds = getattr(config, "layer_types", None)
        windowed = (sum(kind == "sliding_attention" for kind in kinds) if kinds
                    else config.num_hidden_layers if getattr(config, "sliding_window", None) else 0)
        assert planner.model_from_hf_config(config.to_dict(), name=family).windowed_layers == windowed, family
    assert (PRESETS["gemma-2-9b"].windowed_layers, PRESETS["gemma-3-12b"].windowed_layers) == (21, 40)  # 1:1, 5:1
    assert PRESETS["mistral-7b-v0.1"].window == 4096 and PRESETS["mistral-7b-v0.3"].windowed_layers == 0
    assert PRESETS["qwen2.5-7b"].windowed_layers == 0  # use_sliding_window false, as released


def test_an_unknown_family_still_says_it_is_counted_as_llama() -> None:
    shape = planner.model_from_hf_config({"model_type": "olmo2", **TINY}, name="x")
    assert shape.notes == ("model_type olmo2: estimated as a Llama block of its sizes",)
    gemma3 = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
                                                        "intermediate_size": 10240, "num_hidden_layers": 34,
                                                        "sliding_window": 1024}, "vision_config": {}}
    shape = planner.model_from_hf_config(gemma3, name="gemma-3-4b")  # its text_config leaves the rest to defaults
    assert (shape.vocab_size, shape.n_heads, shape.n_kv_heads, shape.head_dim) == (262208, 8, 4, 256)
    assert meta_params(transformers.AutoConfig.for_model(**shape.hf_config())) == shape.params == 3_880_263_168
    assert shape.notes == ("its vision encoder (vision_config) is not counted: the language model's memory alone",)


# ----------------------------------------------------------------------------- activations


def saved_bytes(run, exclude: set[int]) -> int:
    """The bytes autograd saves for backward while `run()` runs: each storage once, `exclude`d ones not."""
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in exclude:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(saved.values())


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_the_mlp_and_qk_norms_save_what_the_planner_counts(family: str) -> None:
    """A block's MLP (a mixture of experts: its router and top-k experts, transformers 5's grouped_mm)
    and its q/k norms, in bf16 on 512 tokens: the bytes they save for backward, beside their inputs and
    the weights, against the planner's per-token terms (within 3%: the MoE's few index tensors)."""
    torch.manual_seed(0)
    config = tiny_config(family)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    shape = planner.model_from_hf_config(config.to_dict(), name=family)
    sizes, tokens = Sizes(shape, Setup(), 512), 512
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layer = model.model.layers[0]  # a MoE layer in each mixture of experts here
    hidden = torch.randn(1, tokens, shape.dim, dtype=torch.bfloat16, requires_grad=True)
    measured = saved_bytes(lambda: layer.mlp(hidden), weights | {hidden.untyped_storage().data_ptr()})
    assert measured == pytest.approx(_mlp_intermediates_per_token(sizes) * tokens, rel=0.03)
    if shape.qk_norm:
        attention = layer.self_attn
        q, k = (torch.randn(1, tokens, heads, shape.head_dim, dtype=torch.bfloat16, requires_grad=True)
                for heads in (shape.n_heads, shape.n_kv_heads))
        inputs = {q.untyped_storage().data_ptr(), k.untyped_storage().data_ptr()}
        measured = saved_bytes(lambda: (attention.q_norm(q), attention.k_norm(k)), weights | inputs)
        # Gemma's norm keeps its fp32 normalized value too (x * (1 + w) in fp32): 2 bytes more an element
        gemma = 2 * (shape.q_dim + shape.kv_dim) * tokens if family.startswith("gemma") else 0
        assert measured == pytest.approx(qk_norm_saved_per_token(sizes) * tokens + gemma, rel=1e-3)


def test_the_family_terms_move_the_memory_as_they_should() -> None:
    """Soft-capped logits keep tanh's output at the loss; the experts' activations grow with top-k; q/k
    norms and Gemma's output norms add to the recomputed block."""
    gemma = PRESETS["gemma-2-2b"]
    uncapped = dataclasses.replace(gemma, logit_softcap=None)
    setup = Setup(logits_kept=False)
    added = loss(Sizes(gemma, setup, 32 * K)).at["loss"] - loss(Sizes(uncapped, setup, 32 * K)).at["loss"]
    assert added == 2 * gemma.vocab_size * 32 * K
    moe = PRESETS["qwen3-30b-a3b"]
    one_expert = dataclasses.replace(moe, experts_per_token=1)
    per_expert = 4 * 2 * moe.expert_ffn_dim + 2 * 2 * moe.dim + 2 * (8 + 4)
    assert (_mlp_intermediates_per_token(Sizes(moe, setup, K)) - _mlp_intermediates_per_token(Sizes(one_expert, setup, K))
            == 7 * per_expert)
    checkpointed = Setup(activation_checkpointing=True, chunked_loss=True)
    plain = dataclasses.replace(PRESETS["qwen3-8b"], qk_norm=False)
    assert planner.peak_gib(PRESETS["qwen3-8b"], checkpointed, 64 * K) > planner.peak_gib(plain, checkpointed, 64 * K)


# ----------------------------------------------------------------------------- dtypes, LoRA


@pytest.mark.parametrize("master_weights", ["fp32", "keep"])
def test_a_bf16_config_json_is_planned_as_the_runtime_trains_it(tmp_path: Path, master_weights: str) -> None:
    """A Qwen3 config.json whose dtype is bf16: the runtime's own upcast (runtime/parallelize.py, what
    apply_fsdp does with master_weights fp32; nothing with keep) makes the bytes the plan counts for the
    parameters on one GPU."""
    from cpctl.runtime.parallelize import upcast_trainable

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **TINY, "dtype": "bfloat16"}))
    shape = planner.load_model(str(tmp_path))
    assert shape.weights_dtype == "bf16" and shape.notes == ()
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # as from_pretrained loads it
    if master_weights == "fp32":
        upcast_trainable(model)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    setup = Setup(master_weights=master_weights)
    parameters = next(term for term in planner.estimate(shape, setup, K).terms if term.name == "parameters")
    assert parameters.at["optimizer_step"] == held == shape.params * (4 if master_weights == "fp32" else 2)
    assert parameters.how.startswith("fp32" if master_weights == "fp32" else "bf16")


def test_lora_on_fused_projections_is_peft_s() -> None:
    peft = pytest.importorskip("peft")
    config = tiny_config("phi3")
    shape = planner.model_from_hf_config(config.to_dict(), name="phi3")
    for targets, lora in (("all-linear", planner.Lora(4)), (["qkv_proj"], planner.Lora(4, targets=("qkv_proj",)))):
        model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                                    peft.LoraConfig(r=4, target_modules=targets))
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert shape.n_layers * lora.params_per_layer(shape) == trained
    with pytest.raises(CpctlError, match="has no such projection; its projections are qkv_proj,o_proj,gate_up_proj"):
        planner.estimate(shape, Setup(lora=planner.Lora(4, targets=("q_proj",))), K)
    with pytest.raises(CpctlError, match="a mixture of experts: cpctl plan does not count peft's adapters"):
        planner.estimate(PRESETS["mixtral-8x7b-v0.1"], Setup(lora=planner.Lora(4)), K)
