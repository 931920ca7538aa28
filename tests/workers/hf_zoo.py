"""Worker: a zoo of tiny Hugging Face causal LMs (attn_implementation="sdpa"), trained under cpctl's CP.

    cpctl launch --device cpu --nproc-per-node 2 --cp-size 2 tests/workers/hf_zoo.py OUT.json [ARCH ...]
        [--wrong-positions] [--wrong-labels] [--quick]

Per architecture, six cases (with --quick, the quick tier's QUICK_CASES), each two SGD steps on new data, compared with the same model
trained as one process on the full sequence:

* "cp": the README loop (`shift_labels`, `position_ids_like`, `maybe_context_parallel`,
  `token_mean`);
* "hf_loss": the way accelerate users call a model: `model(input_ids=ids, labels=ids).loss`, no
  position ids, Hugging Face shifting the labels itself; its CP loss is the CP group's mean of
  the per-rank losses;
* "chunked_loss": `rt.causal_lm_loss(model, input_ids=ids, labels=ids)`, the loss from the final
  hidden states and the output embedding, 7 tokens at a time (the model's own logit scale or
  softcap applied), against the same model's `.loss` in one process;
* "packed": the README loop on rows of packed documents (`PACKED`: position ids restarting,
  `documents=` given to the context, `use_cache=False`), against transformers in one process on
  the same rows (it builds the document mask from the position ids);
* "packed_loss": `model(input_ids=ids, position_ids=pos, labels=ids).loss` on the same packed
  rows with `use_cache` at the config's default, as transformers computes it in one process
  (with a KV cache it reads no documents from position ids: attention crosses them);
* "packed_chunked_loss": `rt.causal_lm_loss(model, input_ids=ids, labels=ids, position_ids=pos)`
  on the packed rows (without a cache: documents), against `.loss` with `use_cache=False`.

Each case records both sides' losses, the max abs loss difference, the max abs difference of the
full gradients after step 1, the sequence length the CP model saw (`local_len`, 64 / cp: CP was
really on), how many calls the CP engine made (`engine_calls`: at cp 1 too, attention went
through it), and any exception as one line (one architecture failing does not stop the others).
Flags replace the two cases by deliberate mistakes in the README loop, to prove the comparison
can fail: `--wrong-positions` (case "wrong_positions") feeds local positions `arange(local_len)`,
`--wrong-labels` (case "wrong_labels") shifts the labels on each shard instead of the full
sequence.

Rank 0 writes {arch: {case: {...}}} to OUT.json, rewritten after every architecture ({} for one
not run yet): a rank failing alone can leave the other inside a collective, which kills the launch
(or, after ARCH_TIMEOUT, this worker's watchdog does). Errors are also printed at once as
`zoo-error rankR ARCH/CASE: ...`, and tests/test_hf_zoo.py relaunches the architectures left.
Under plain `python` the world is one process at cp 1 (as `--nproc-per-node 1 --cp-size 1`):
attention still goes through cpctl's engine. Nothing is downloaded: every model is built from a config.
"""

from __future__ import annotations

import copy
import faulthandler
import json
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import transformers as hf

import cpctl
from cpctl.runtime.runtime import step_context

VOCAB, BATCH, SEQ, STEPS, LR = 128, 2, 64, 2, 0.1
# cp 2 with head-tail load balancing cuts 64 tokens into 4 chunks of 16: a window of 24 reaches
# over a chunk boundary but not over the whole sequence.
WINDOW = 24
MISTAKES = {"--wrong-positions": "wrong_positions", "--wrong-labels": "wrong_labels"}  # flag -> case
ARCH_TIMEOUT = 90  # seconds for one architecture (both cases); each takes a few seconds on 2 CPU cores
# initializer_range 0.1 (not 0.02): attention far from uniform, so a wrong window, chunk, mask or
# position changes the gradients by ~1e-2, three orders above the tolerance.
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, attention_dropout=0.0, tie_word_embeddings=False, initializer_range=0.1,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
MIXED = ["sliding_attention", "full_attention"]
# Documents per row (each row adds up to SEQ): longer than the window and the attention chunk,
# one-token documents, and boundaries that cut through the chunks cp 2 shards by.
PACKED = [[5, 1, 30, 20, 8], [40, 1, 23]]
CASES = ("cp", "hf_loss", "chunked_loss", "packed", "packed_loss", "packed_chunked_loss")
PACKED_CASES = tuple(case for case in CASES if case.startswith("packed"))
# --quick (the quick tier): half the cases, each loss path and packed documents still once
QUICK_CASES = ("cp", "hf_loss", "packed_chunked_loss")


def _llama() -> nn.Module:
    return hf.LlamaForCausalLM(hf.LlamaConfig(**COMMON, num_hidden_layers=2))


def _mistral() -> nn.Module:  # every layer sliding
    return hf.MistralForCausalLM(hf.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW))


def _qwen2() -> nn.Module:  # sliding + full, attention bias on q/k/v
    return hf.Qwen2ForCausalLM(hf.Qwen2Config(**COMMON, num_hidden_layers=2, use_sliding_window=True,
                                              sliding_window=WINDOW, max_window_layers=2, layer_types=MIXED))


def _qwen3() -> nn.Module:  # QK norm
    return hf.Qwen3ForCausalLM(hf.Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=8))


def _qwen3_moe() -> nn.Module:
    return hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(**COMMON, num_hidden_layers=2, head_dim=8, num_experts=4,
                                                    num_experts_per_tok=2, moe_intermediate_size=32,
                                                    decoder_sparse_step=1, output_router_logits=False))


def _gemma3() -> nn.Module:  # sliding + full, QK norm, final logit softcapping, no attention softcapping
    return hf.Gemma3ForCausalLM(hf.Gemma3TextConfig(**COMMON, num_hidden_layers=2, head_dim=8, sliding_window=WINDOW,
                                                    layer_types=MIXED, attn_logit_softcapping=None,
                                                    final_logit_softcapping=30.0, query_pre_attn_scalar=8))


def _gemma2() -> nn.Module:  # sliding + full, attention softcapping off
    # Gemma2 declares no SDPA support (because of softcapping): build it eager, then switch the shared
    # config to SDPA, which is exact once attn_logit_softcapping is None.
    cfg = {**COMMON, "attn_implementation": "eager"}
    model = hf.Gemma2ForCausalLM(hf.Gemma2Config(**cfg, num_hidden_layers=2, head_dim=8, sliding_window=WINDOW,
                                                 layer_types=MIXED, attn_logit_softcapping=None,
                                                 final_logit_softcapping=None, query_pre_attn_scalar=8))
    model.config._attn_implementation = "sdpa"
    return model


def _cohere2() -> nn.Module:  # sliding (RoPE) + full (no RoPE), layer norm, logit scale
    return hf.Cohere2ForCausalLM(hf.Cohere2Config(**COMMON, num_hidden_layers=2, sliding_window=WINDOW,
                                                  layer_types=MIXED))


def _llama4() -> nn.Module:  # chunked attention (RoPE) + full (no RoPE), MoE in every layer
    return hf.Llama4ForCausalLM(hf.Llama4TextConfig(**COMMON, num_hidden_layers=2, head_dim=8, intermediate_size_mlp=64,
                                                    num_local_experts=4, num_experts_per_tok=1,
                                                    interleave_moe_layer_step=1, no_rope_layers=[1, 0],
                                                    attention_chunk_size=WINDOW, output_router_logits=False))


def _deepseek_v3() -> nn.Module:  # MLA: q/k head dim 16 (8 nope + 8 rope), v head dim 8; MoE after a dense layer
    cfg = {**COMMON, "num_key_value_heads": 4}
    return hf.DeepseekV3ForCausalLM(hf.DeepseekV3Config(
        **cfg, num_hidden_layers=2, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, output_router_logits=False))


def _mixtral() -> nn.Module:
    return hf.MixtralForCausalLM(hf.MixtralConfig(**COMMON, num_hidden_layers=2, num_local_experts=4,
                                                  num_experts_per_tok=2, output_router_logits=False))


def _phi3() -> nn.Module:  # partial rotary 0.5, fused qkv
    return hf.Phi3ForCausalLM(hf.Phi3Config(**COMMON, num_hidden_layers=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.5}))


def _stablelm() -> nn.Module:  # partial rotary 0.25, per-head QK layer norm, parallel residual
    return hf.StableLmForCausalLM(hf.StableLmConfig(**COMMON, num_hidden_layers=2, qk_layernorm=True,
                                                    use_parallel_residual=True, hidden_dropout=0.0))


def _gpt_neox() -> nn.Module:  # partial rotary 0.25, MHA, parallel residual
    cfg = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}
    return hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(**cfg, num_hidden_layers=2, hidden_dropout=0.0))


def _olmo2() -> nn.Module:  # QK norm over all heads
    return hf.Olmo2ForCausalLM(hf.Olmo2Config(**COMMON, num_hidden_layers=2))


def _granite() -> nn.Module:  # attention_multiplier: an SDPA scale other than 1/sqrt(head_dim)
    return hf.GraniteForCausalLM(hf.GraniteConfig(**COMMON, num_hidden_layers=2, attention_multiplier=0.25,
                                                  embedding_multiplier=2.0, residual_multiplier=0.5,
                                                  logits_scaling=2.0))


def _smollm3() -> nn.Module:  # a NoPE layer
    return hf.SmolLM3ForCausalLM(hf.SmolLM3Config(**COMMON, num_hidden_layers=2, no_rope_layers=[1, 0]))


def _glm4() -> nn.Module:  # partial rotary 0.5 (interleaved), extra post norms
    return hf.Glm4ForCausalLM(hf.Glm4Config(**COMMON, num_hidden_layers=2, head_dim=8))


def _falcon() -> nn.Module:  # no AttentionInterface: calls SDPA itself; multi-query (one K/V head), parallel attention
    return hf.FalconForCausalLM(hf.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=256,
        attention_dropout=0.0, hidden_dropout=0.0, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, attn_implementation="sdpa"))


def _opt() -> nn.Module:  # learned positions (offset 2); builds its causal mask without position ids
    cfg = {k: v for k, v in COMMON.items() if k not in ("num_key_value_heads", "intermediate_size", "initializer_range")}
    return hf.OPTForCausalLM(hf.OPTConfig(**cfg, num_hidden_layers=2, ffn_dim=64, init_std=0.1, dropout=0.0))


def _roberta() -> nn.Module:  # as a decoder: learned positions counted from its padding token when none are given
    cfg = {k: v for k, v in COMMON.items() if k not in ("num_key_value_heads",)}
    return hf.RobertaForCausalLM(hf.RobertaConfig(**cfg, num_hidden_layers=2, is_decoder=True, hidden_dropout_prob=0.0,
                                                  attention_probs_dropout_prob=0.0))


def _bart() -> nn.Module:  # a decoder whose forward takes no position ids: refused under CP
    cfg = {k: v for k, v in COMMON.items() if k not in ("num_key_value_heads", "hidden_size", "intermediate_size",
                                                        "num_attention_heads", "initializer_range")}
    return hf.BartForCausalLM(hf.BartConfig(**cfg, d_model=32, decoder_layers=2, encoder_layers=2,
                                            decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=64,
                                            encoder_ffn_dim=64, init_std=0.1, dropout=0.0, is_decoder=True,
                                            is_encoder_decoder=False, add_cross_attention=False))


ARCHS: dict[str, Callable[[], nn.Module]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe,
    "gemma3": _gemma3, "gemma2": _gemma2, "cohere2": _cohere2, "llama4": _llama4, "deepseek_v3": _deepseek_v3,
    "mixtral": _mixtral, "phi3": _phi3, "stablelm": _stablelm, "gpt_neox": _gpt_neox, "olmo2": _olmo2,
    "granite": _granite, "smollm3": _smollm3, "glm4": _glm4, "falcon": _falcon, "opt": _opt, "roberta": _roberta,
    "bart": _bart,
}


def batch(step: int, device: torch.device) -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step)).to(device)


def full_grad(param: nn.Parameter) -> torch.Tensor:
    grad = param.grad
    if grad is None:
        return torch.zeros(param.shape)
    return (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().cpu()


def packed_positions(device: torch.device) -> torch.Tensor:
    return cpctl.position_ids_for_documents(PACKED, device=device)


def reference_loss(model: nn.Module, ids: torch.Tensor, case: str) -> torch.Tensor:
    if case in ("hf_loss", "chunked_loss"):
        return model(input_ids=ids, labels=ids.clone(), use_cache=False).loss
    if case == "packed_loss":  # use_cache left to the config (True): transformers then reads no documents
        return model(input_ids=ids, position_ids=packed_positions(ids.device), labels=ids.clone()).loss
    if case == "packed_chunked_loss":
        return model(input_ids=ids, position_ids=packed_positions(ids.device), labels=ids.clone(), use_cache=False).loss
    if case == "packed":
        pos = packed_positions(ids.device)
        labels = cpctl.shift_labels(ids, position_ids=pos)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
    labels = cpctl.shift_labels(ids)
    logits = model(input_ids=ids, position_ids=cpctl.position_ids_like(ids), use_cache=False).logits
    loss_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss_sum / (labels != -100).sum()


def cp_loss(rt: cpctl.Runtime, model: nn.Module, ids: torch.Tensor, case: str) -> tuple[float, int]:
    """One CP forward + backward: the loss every rank agrees on, and the sequence length the model saw."""
    if case in PACKED_CASES:
        return packed_cp_loss(rt, model, ids, case)
    if case == "chunked_loss":
        raw = ids.clone()
        with rt.maybe_context_parallel(buffers=[ids, raw], buffer_seq_dims=[1, 1], no_restore_buffers={ids, raw}):
            loss = rt.causal_lm_loss(model, input_ids=ids, labels=raw)
            loss.backward()
        return loss.item(), ids.shape[1]
    if case == "hf_loss":
        raw = ids.clone()
        with rt.maybe_context_parallel(buffers=[ids, raw], buffer_seq_dims=[1, 1], no_restore_buffers={ids, raw}):
            output = model(input_ids=ids, labels=raw, use_cache=False)
            output.loss.backward()
        loss = output.loss
        value = loss.detach().float().clone()
        if rt.cp_size > 1:  # each rank's own mean: report the CP group's mean
            dist.all_reduce(value, group=rt.axes["cp"].get_group())
            value /= rt.cp_size
        return value.item(), output.logits.shape[1]
    labels = cpctl.shift_labels(ids)
    pos = cpctl.position_ids_like(ids)
    with rt.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                   no_restore_buffers={ids, labels, pos}):
        if case == "wrong_positions":  # the shard's own arange: wrong RoPE positions for remote chunks
            pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        if case == "wrong_labels":  # next-token labels of the shard: wrong at the chunk boundaries
            labels = cpctl.shift_labels(ids)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        loss = rt.token_mean(loss_sum, labels)
        loss.backward()
    return loss.item(), logits.shape[1]


def packed_cp_loss(rt: cpctl.Runtime, model: nn.Module, ids: torch.Tensor, case: str) -> tuple[float, int]:
    full_pos = packed_positions(ids.device)
    pos, raw = full_pos.clone(), ids.clone()
    labels = cpctl.shift_labels(ids, position_ids=full_pos)
    buffers = [ids, raw, pos, labels]
    documents = {"documents": full_pos} if case == "packed" else {}
    with rt.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * 4, no_restore_buffers=set(buffers),
                                   **documents):
        if case == "packed":
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            loss_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                                       reduction="sum")
            loss = rt.token_mean(loss_sum, labels)
        elif case == "packed_chunked_loss":
            loss = rt.causal_lm_loss(model, input_ids=ids, labels=raw, position_ids=pos)
        else:  # packed_loss: .loss, use_cache at the config's default
            loss = model(input_ids=ids, position_ids=pos, labels=raw).loss
        loss.backward()
    return loss.item(), ids.shape[1]


def run_case(rt: cpctl.Runtime, name: str, base: nn.Module, case: str) -> dict:
    result: dict = {"losses_ref": [], "losses_cp": [], "loss_diff": None, "grad_diff": None, "error": None}
    try:
        reference = copy.deepcopy(base)
        reference_opt = torch.optim.SGD(reference.parameters(), lr=LR)
        model = rt.prepare_model(copy.deepcopy(base))
        opt = torch.optim.SGD(model.parameters(), lr=LR)  # after prepare_model: FSDP's sharded parameters
        for step in range(STEPS):
            ids = batch(step, rt.device)
            loss = reference_loss(reference, ids.clone().cpu(), case)
            loss.backward()
            result["losses_ref"].append(loss.item())
            calls = step_context(rt).attention_calls
            value, result["local_len"] = cp_loss(rt, model, ids.clone(), case)
            result["engine_calls"] = step_context(rt).attention_calls - calls
            result["losses_cp"].append(value)
            if step == 0:
                ref_grads = {n: full_grad(p) for n, p in reference.named_parameters()}
                cp_grads = {n: full_grad(p) for n, p in model.named_parameters()}
                if set(ref_grads) != set(cp_grads):
                    raise RuntimeError(f"parameter names differ: {sorted(set(ref_grads) ^ set(cp_grads))[:4]}")
                result["grad_diff"] = max((cp_grads[n] - g).abs().max().item() for n, g in ref_grads.items())
                result["n_params"] = sum(p.numel() for p in reference.parameters())
            for optimizer in (reference_opt, opt):
                optimizer.step()
                optimizer.zero_grad()
        result["loss_diff"] = max(abs(a - b) for a, b in zip(result["losses_ref"], result["losses_cp"]))
    except Exception as error:  # noqa: BLE001 - recorded, one line, and the zoo goes on
        where = traceback.extract_tb(error.__traceback__)[-1]
        first = (str(error).strip().splitlines() or [""])[0]
        result["error"] = f"{type(error).__name__}: {first} [{where.filename.rsplit('/', 1)[-1]}:{where.lineno}]"
        # Printed at once: if the other rank is left inside a collective, the launch may die before the JSON.
        print(f"zoo-error rank{rt.rank} {name}/{case}: {result['error']}", file=sys.stderr, flush=True)
    return result


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    quick = "--quick" in flags
    flags = [f for f in flags if f != "--quick"]
    if set(flags) - set(MISTAKES):
        raise SystemExit(f"unknown flag(s) {sorted(set(flags) - set(MISTAKES))}; known: {[*MISTAKES, '--quick']}")
    out, names = args[0], args[1:] or list(ARCHS)
    unknown = [n for n in names if n not in ARCHS]
    if unknown:
        raise SystemExit(f"unknown architecture(s) {unknown}; known: {list(ARCHS)}")
    rt = cpctl.init(loss_chunk_tokens=7)  # chunks that cut through shards and rows
    # Every requested architecture has an entry from the start: an empty one was not run (yet).
    results: dict = {name: {} for name in names}

    def save() -> None:
        if rt.is_main:
            with open(out, "w") as f:
                json.dump(results, f, indent=1)

    save()
    cases = tuple(MISTAKES[f] for f in flags) or (QUICK_CASES if quick else CASES)
    for name in names:
        start = time.perf_counter()
        # A rank that fails alone leaves the other inside a collective: gloo then aborts or waits for
        # 30 minutes. Die after ARCH_TIMEOUT instead; the test relaunches the architectures not yet run.
        faulthandler.dump_traceback_later(ARCH_TIMEOUT, exit=True)
        torch.manual_seed(0)
        try:
            base = ARCHS[name]()
            if base.config._attn_implementation != "sdpa":
                raise RuntimeError(f"attn_implementation is {base.config._attn_implementation!r}, not 'sdpa'")
            base.train()
        except Exception as error:  # noqa: BLE001
            line = f"build: {type(error).__name__}: {error}".splitlines()[0]
            base = None
        results[name] = {}
        for case in cases:
            mine = run_case(rt, name, base, case) if base is not None else {"error": line}
            if rt.world_size > 1:  # an error on any rank is recorded (rank 0's first, else another's)
                every: list = [None] * rt.world_size
                dist.all_gather_object(every, mine)
                mine = next((r for r in every if r.get("error")), every[0])
            results[name][case] = mine
        faulthandler.cancel_dump_traceback_later()
        save()  # after every architecture, so a later crash keeps what was done
        if rt.is_main:
            cells = (f"{c}={r.get('error') or (r['loss_diff'], r['grad_diff'])}" for c, r in results[name].items())
            print(f"zoo {name}: {time.perf_counter() - start:.1f}s", *cells, flush=True)


if __name__ == "__main__":
    main()
