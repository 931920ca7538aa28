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
    """In tiles the blocks' norms keep their bf16 output only (not the fp32 input and normalized value:
    4 + 2 bytes a channel), and their fp32 backward is one tile's: on an H200 the peak of a tiled run
    is the kernel's backward with no norm tensor live (scripts/cuda_memory_report.py). The final norm,
    tiled too, leaves its input and that input's gradient at the loss's moment, and only its output in
    host memory (docs/benchmarks/tiled_norms_1b_h200.jsonl: 42.95 GiB tiled, 57.89 whole at 512k;
    test_planner.py checks each recorded peak and host figure)."""
    from cpctl.planner import Sizes
    from cpctl.planner.terms import attention_working_set, final_norm_backward_per_token, offloaded_per_token

    model, tokens = PRESETS["llama-3.2-1b"], 512 * K
    base = Setup(activation_checkpointing=True, chunked_loss=True, tiled_mlp_tokens=8192, offload_activations=True)
    whole, tiled = (Sizes(model, dataclasses.replace(base, tiled_norm_tokens=t), tokens) for t in (0, 8192))
    saved, norm_backward = 6 * model.dim * tokens, 16 * model.dim * tokens
    gqa_workspace = 4 * model.q_dim * tokens  # the larger of the two after the norm's
    drop = attention_working_set(whole).at["attention_backward"] - attention_working_set(tiled).at["attention_backward"]
    assert drop == pytest.approx(saved + norm_backward - gqa_workspace, rel=1e-9)
    assert attention_working_set(tiled).how.endswith("the kernel's GQA workspace")
    assert final_norm_backward_per_token(tiled) == 2 * 2 * model.dim  # its bf16 input, back from host, and gradient
    assert final_norm_backward_per_token(whole) == (5 + 1) * 4 * model.dim
    assert offloaded_per_token(whole) - offloaded_per_token(tiled) == 4 * model.dim + 4  # fp32 input, inverse RMS
    assert "norms in tiles of 8192 tokens" in tiled.setup.describe()


def test_a_whole_sequence_kernel_call_counts_its_gqa_workspace() -> None:
    """One kernel call over the whole sequence (cp 1) takes GQA's K/V at their own heads; its backward
    allocates 2 fp32 copies of q beyond its gradients with GQA, 1 without (scripts/probe_kernels.py on
    an H200: 2.01 and 1.01, cuDNN and flash alike); the planner's gradients count the first copy."""
    from cpctl.planner import Sizes
    from cpctl.planner.terms import attention_working_set

    setup = Setup(activation_checkpointing=True, chunked_loss=True, tiled_norm_tokens=8192)
    gqa = PRESETS["llama-3.1-8b"]
    mha = dataclasses.replace(gqa, n_kv_heads=gqa.n_heads)
    tokens = 64 * K
    gqa_term, mha_term = (attention_working_set(Sizes(m, setup, tokens)) for m in (gqa, mha))
    assert gqa_term.how.endswith("the kernel's GQA workspace") and not mha_term.how.endswith("workspace")
    kv_bytes = (2 + 2) * 2 * (mha.kv_dim - gqa.kv_dim) * tokens  # mha's larger k, v, saved and as gradients
    assert mha_term.at["attention_backward"] - gqa_term.at["attention_backward"] == pytest.approx(
        kv_bytes - 4 * gqa.q_dim * tokens, rel=1e-9)
    ring = attention_working_set(Sizes(gqa, setup.with_cp(2), tokens))
    assert not ring.how.endswith("workspace")  # the ring's blocks: the engine's fp32 merge buffers, counted apart


def test_the_8b_shape_with_ulysses_and_every_memory_option() -> None:
    """DeepSpeed's ALST trains Llama-3.1-8B at 3.7M tokens on 8 H100s with Ulysses. cpctl's plan, with
    every memory option and Ulysses over the 8 GPUs on a 2 TiB host, reaches it: 4889k tokens (k =
    1024) with the norms tiled, 3912k without; the ring alone 3603k (docs/cli.md)."""
    model = PRESETS["llama-3.1-8b"]
    setup = Setup(activation_checkpointing=True, chunked_loss=True, tiled_mlp_tokens=8192, tiled_norm_tokens=8192,
                  offload_activations=True, cpu_offload=True).with_sp(8, 8)
    memory = {"gpu_memory_gib": 80, "host_memory_gib": 2048}
    tiled = planner.longest_fitting(model, setup, **memory)
    untiled = planner.longest_fitting(model, dataclasses.replace(setup, tiled_norm_tokens=0), **memory)
    assert 4800 * K < tiled < 5000 * K and 3700 * 1000 < untiled < 4000 * K
    ring = planner.longest_fitting(model, setup.with_cp(8), **memory)
    assert 3500 * K < ring < tiled  # Ulysses holds the sequence's K/V for 1/8 of the heads; the ring for all


def test_a_layer_given_tokens_without_a_batch_dim_is_refused_in_one_line() -> None:
    block = nn.Module()
    block.norm = nn.LayerNorm(4)
    apply_tiled_norms([block], tile_tokens=2)
    with pytest.raises(CpctlError, match=r"LayerNorm gets a 2-D tensor \(3, 4\); tiles split \(batch, tokens, width\)"):
        block.norm(torch.zeros(3, 4))
