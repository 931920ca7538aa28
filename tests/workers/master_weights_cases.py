"""Worker for tests/test_master_weights.py: a bf16 Hugging Face Llama through rt.prepare_model.

    python tests/workers/master_weights_cases.py OUT.json      # a world of one (cpu, mixed_precision no)

transformers 5 loads a checkpoint in its own dtype (bf16 for the Llama releases); this builds
such a model (a tiny LlamaForCausalLM moved to bf16) and records, per case, the dtypes of its
parameters, gradients, AdamW states and buffers after prepare_model and one step, the share of
weights one small AdamW step changed, the gradients against an fp32 copy trained the plain way,
and the `cpctl` logger's lines. Cases differ in fsdp.master_weights, fsdp.mixed_precision and
which parameters are frozen (a second Runtime on the same mesh, as runtime_cases.py's
`variant`). The assertions live in the test.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import sys
import traceback

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import cpctl
from cpctl.runtime.runtime import Runtime, step_context

LR = 1e-5  # an Adam step moves each weight by about this: below bf16's resolution at the init's 0.02 scale


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def bf16_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def variant(rt: Runtime, **fsdp) -> Runtime:
    config = dataclasses.replace(rt.config, fsdp=dataclasses.replace(rt.config.fsdp, **fsdp))
    return Runtime(config, step_context(rt).mesh, rt.device)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def dtypes(named) -> dict[str, str]:
    return {name: str(tensor.dtype).removeprefix("torch.") for name, tensor in named}


def trained(rt: Runtime, *, frozen: tuple[str, ...] = ()) -> dict:
    model = bf16_llama()
    for name, param in model.named_parameters():
        param.requires_grad_(not name.startswith(frozen))
    # the reference: the trainable bf16 weights as fp32, the frozen ones and buffers as they are; one
    # plain process, the full sequence
    reference = copy.deepcopy(model)
    for param in reference.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    buffers_before = dtypes(model.named_buffers())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.randint(128, (2, 32), generator=torch.Generator().manual_seed(1))
    model = rt.prepare_model(model)
    arrived = dtypes(model.named_parameters())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    inputs, labels = ids.clone(), ids.clone()
    with rt.maybe_context_parallel(buffers=[inputs, labels], buffer_seq_dims=[1, 1],
                                   no_restore_buffers={inputs, labels}):
        output = model(input_ids=inputs, labels=labels)
        output.loss.backward()
    grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    reference(input_ids=ids, labels=ids).loss.backward()
    plain = dict(reference.named_parameters())
    grad_err = max((grads[name].double() - plain[name].grad.double()).abs().max().item() for name in grads)
    optimizer.step()
    after = {name: full(p.detach()) for name, p in model.named_parameters()}
    moved = {name: (after[name].float() != before[name].float()).float().mean().item() for name in after}
    states = {str(tensor.dtype).removeprefix("torch.") for state in optimizer.state.values()
              for tensor in state.values() if torch.is_tensor(tensor) and tensor.dim() > 0}
    return {
        "params": arrived, "params_after_step": dtypes(after.items()), "grads": dtypes(grads.items()),
        "states": sorted(states), "buffers_before": buffers_before, "buffers": dtypes(model.named_buffers()),
        "logits": str(output.logits.dtype).removeprefix("torch."), "grad_err": grad_err, "moved": moved,
        "frozen_unchanged": all(torch.equal(after[name], before[name]) for name in after if name.startswith(frozen))
        if frozen else None,
    }


def main(out: str) -> None:
    lines = Lines()
    logging.getLogger("cpctl").addHandler(lines)
    logging.getLogger("cpctl").setLevel(logging.DEBUG)
    rt = cpctl.init()
    cases = {
        "fp32": lambda: trained(rt),
        "again": lambda: trained(rt),  # a second model in the process: said at DEBUG, not again at INFO
        "keep": lambda: trained(variant(rt, master_weights="keep")),
        "frozen": lambda: trained(rt, frozen=("model.embed_tokens.",)),
        "bf16_compute": lambda: trained(variant(rt, mixed_precision="bf16")),
    }
    results = {}
    for name, case in cases.items():
        start = len(lines.lines)
        try:
            results[name] = case()
        except Exception:  # noqa: BLE001 - the test shows the traceback
            results[name] = {"crashed": traceback.format_exc()}
        results[name]["lines"] = lines.lines[start:] if "crashed" not in results[name] else []
    if rt.is_main:
        with open(out, "w", encoding="utf-8") as file:
            json.dump({"world": rt.world_size, "mixed_precision": rt.config.fsdp.mixed_precision,
                       "cases": results}, file)


if __name__ == "__main__":
    main(sys.argv[1])
