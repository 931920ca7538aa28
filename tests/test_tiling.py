"""Token-wise layers in tiles (memory.tiled_mlp_tokens, memory.tiled_norm_tokens): the same
losses and gradients as the whole layers, in one process; the planner's accounting of them.

Under CP the same tiling runs inside checkpointed blocks in tests/test_training.py
("cp2-tiled") and on a Hugging Face model in tests/test_huggingface.py ("cp2-tiled").
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from cpctl import planner
from cpctl.errors import CpctlError
from cpctl.planner import PRESETS, Setup
from cpctl.runtime.tiling import TiledForward, apply_tiled_mlp, apply_tiled_norms, tiled_layers

K = 1024


def tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tiles", [(0, 5), (7, 0), (4, 16)], ids=["norms-5", "mlp-7", "mlp-4-norms-16"])
def test_tiled_layers_compute_what_the_whole_layers_do(tiles) -> None:
    mlp_tokens, norm_tokens = tiles
    reference = tiny_llama()
    tiled = copy.deepcopy(reference)
    blocks = list(tiled.model.layers)
    if mlp_tokens:
        apply_tiled_mlp(blocks, tile_tokens=mlp_tokens)
    if norm_tokens:
        apply_tiled_norms(blocks, tile_tokens=norm_tokens, model=tiled)
    keys = [layer.key for layer in tiled_layers(tiled)]
    assert keys.count("memory.tiled_mlp_tokens") == (2 if mlp_tokens else 0)
    assert keys.count("memory.tiled_norm_tokens") == (5 if norm_tokens else 0)  # input, post-attention and final norms
    if norm_tokens:
        assert isinstance(tiled.model.norm.__dict__.get("forward"), TiledForward)
    ids = torch.randint(0, 64, (2, 37))  # tiles that do not divide the sequence
    want_loss, want = loss_and_grads(reference, ids)
    got_loss, got = loss_and_grads(tiled, ids)
    assert set(got) == set(want)  # parameter names unchanged
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_block_without_norms_is_refused_in_one_line() -> None:
    blocks = [nn.Sequential(nn.Linear(4, 4))]
    with pytest.raises(CpctlError, match=r"tiled_norm_tokens: no LayerNorm or RMSNorm among Sequential's direct "
                                         r"children; set memory.tiled_norm_tokens: 0"):
        apply_tiled_norms(blocks, tile_tokens=8)


def test_a_norm_given_two_tensors_is_refused_at_its_call() -> None:
    class TwoInputNorm(nn.LayerNorm):
        def forward(self, hidden, residual):  # a fused add-and-norm
            return super().forward(hidden + residual)

    block = nn.Module()
    block.norm = TwoInputNorm(4)
    apply_tiled_norms([block], tile_tokens=2)
    with pytest.raises(CpctlError, match="takes more than one"):
        block.norm(torch.zeros(1, 4, 4), torch.zeros(1, 4, 4))


# ----------------------------------------------------------------------------- the planner


def test_tiled_norms_are_credited_with_what_the_gpu_showed() -> None:
    """The recomputed input norm keeps its bf16 output only, not its fp32 input and normalized value
    (4 + 2 bytes a channel): the 6.0 GiB the H200 showed at 512k (57.89 -> 51.95 GiB). Its fp32
    backward stays counted whole: on the GPU the moment held as much with the norms in tiles."""
    model, tokens = PRESETS["llama-3.2-1b"], 512 * K
    base = Setup(activation_checkpointing=True, chunked_loss=True, tiled_mlp_tokens=8192, offload_activations=True)
    whole, tiled = (planner.estimate(model, dataclasses.replace(base, tiled_norm_tokens=t), tokens) for t in (0, 8192))
    saved = 6 * model.dim * tokens
    assert whole.total("attention_backward") - tiled.total("attention_backward") == pytest.approx(saved, rel=1e-9)
    assert (whole.peak - tiled.peak) / planner.GiB == pytest.approx(57.89 - 51.95, abs=0.5)
    assert "norms in tiles of 8192 tokens" in tiled.setup.describe()
    # the final norm is not a block's: its backward at the start of backward, its fp32 input back from
    # host memory and 5 fp32 temporaries (scripts/memory_trace_cpu.py), is whole either way
    final_norm = (4 + 5 * 4) * model.dim * tokens
    assert whole.total("loss") == tiled.total("loss")
    assert next(term for term in tiled.terms if term.name == "loss").at["loss"] == final_norm


def test_gqa_widening_in_the_kernel_backward_is_counted() -> None:
    """At cp 1 (and Ulysses over one ring rank) the kernel's backward widens K/V and their gradients
    to q's heads: 4 tensors of (q_dim - kv_dim); the moment holds it or the norm's backward, the larger."""
    from cpctl.planner import Sizes
    from cpctl.planner.terms import attention_working_set

    setup = Setup(activation_checkpointing=True, chunked_loss=True)
    llama = PRESETS["llama-3.1-8b"]  # q_dim = dim: the norm's 16 bytes a channel are the larger
    sizes = Sizes(llama, setup, 64 * K)
    assert 8 * (llama.q_dim - llama.kv_dim) < 16 * llama.dim
    assert attention_working_set(sizes).how.endswith("the norm's fp32 backward")
    wide = dataclasses.replace(llama, n_heads=64, head_dim=256)  # q_dim 16384, 4 x dim: the widening is larger
    mha = dataclasses.replace(wide, n_kv_heads=64)  # the same q, no GQA: nothing widened
    wide_term, mha_term = (attention_working_set(Sizes(m, setup, 64 * K)) for m in (wide, mha))
    assert wide_term.how.endswith("GQA's K/V widened in the kernel's backward")
    tokens = 64 * K
    widened = 8 * (wide.q_dim - wide.kv_dim) * tokens
    norm = 16 * wide.dim * tokens
    kv_bytes = (2 * 2 * (mha.kv_dim - wide.kv_dim) * 2) * tokens  # mha's larger k, v and their gradients, saved and grads
    assert mha_term.at["attention_backward"] - wide_term.at["attention_backward"] == pytest.approx(
        norm - widened + kv_bytes, rel=1e-9)


def test_the_8b_shape_with_ulysses_and_every_memory_option() -> None:
    """DeepSpeed's ALST trains Llama-3.1-8B at 3.7M tokens on 8 H100s with Ulysses. cpctl's plan,
    with every memory option and Ulysses over the 8 GPUs on a 2 TiB host, reaches 2,795k with the
    norms tiled (2,490k without): 3.7M needs the attention backward's working set cut further
    (docs/cli.md says what remains)."""
    model = PRESETS["llama-3.1-8b"]
    setup = Setup(activation_checkpointing=True, chunked_loss=True, tiled_mlp_tokens=8192, tiled_norm_tokens=8192,
                  offload_activations=True, cpu_offload=True).with_sp(8, 8)
    memory = {"gpu_memory_gib": 80, "host_memory_gib": 2048}
    tiled = planner.longest_fitting(model, setup, **memory)
    untiled = planner.longest_fitting(model, dataclasses.replace(setup, tiled_norm_tokens=0), **memory)
    assert 2700 * K < tiled < 2900 * K and 2400 * K < untiled < 2600 * K
    ring = planner.longest_fitting(model, setup.with_cp(8), **memory)
    assert tiled > ring  # Ulysses holds the sequence's K/V for 1/8 of the heads; the ring for all


def test_a_layer_given_tokens_without_a_batch_dim_is_refused_in_one_line() -> None:
    block = nn.Module()
    block.norm = nn.LayerNorm(4)
    apply_tiled_norms([block], tile_tokens=2)
    with pytest.raises(CpctlError, match=r"LayerNorm gets a 2-D tensor \(3, 4\); tiles split \(batch, tokens, width\)"):
        block.norm(torch.zeros(3, 4))
