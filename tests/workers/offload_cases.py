"""Worker for tests/test_offload.py, one plain process (a world of one, on CPU):

    python offload_cases.py OUT [--offload] [cpctl.init overrides as key=value ...]

Trains the example Llama (4 layers) for 3 AdamW steps under the given checkpointing, beside the
same model trained plainly (no checkpointing), and writes to OUT: the losses of both, the
largest parameter difference after the steps, the selective block count the runtime applied,
and with --offload the host arena's counters after each step and `cpctl plan`'s host memory and
selective block count for the same setup (the arena holds what each selective block keeps of
attention, so its size shows how many blocks were selective). Then a forward that raises inside the model, and what an autograd
op outside the model saves afterwards. The profile refuses offload_activations on cpu (there
is no GPU memory to move), so --offload installs the arena the runtime would.
"""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import cpctl
from cpctl import planner
from cpctl.runtime.pinned import HostArena, offload_saved_activations
from cpctl.runtime.runtime import preparation

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from llama import Llama, LlamaConfig  # noqa: E402

CONFIG = LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=128)
BATCH, SEQ, STEPS = 2, 128, 3


def parse_overrides(items: list[str]) -> dict:
    overrides = {}
    for item in items:
        name, value = item.split("=", 1)
        overrides[name] = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
    return overrides


def step(model, optimizer, ids) -> float:
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), cpctl.shift_labels(ids).flatten(), ignore_index=-100)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    out, offload, overrides = sys.argv[1], "--offload" in sys.argv, parse_overrides(
        [a for a in sys.argv[2:] if a != "--offload"])
    rt = cpctl.init(activation_checkpointing=True, **overrides)
    torch.manual_seed(0)
    reference = Llama(CONFIG)
    model = copy.deepcopy(reference)
    arena = None
    if offload:
        arena = preparation(rt)._host_arena = HostArena(rt.device)
    model = rt.prepare_model(model)
    if offload:
        offload_saved_activations(model, arena=arena)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(CONFIG.vocab_size, (BATCH, SEQ), generator=gen) for _ in range(STEPS + 1)]

    result = {"losses": [], "reference": [], "arena": []}
    for ids in batches[:STEPS]:
        result["reference"].append(step(reference, ref_opt, ids))
        result["losses"].append(step(model, opt, ids))
        if arena is not None:
            result["arena"].append({"allocations": arena.allocations, "peak_bytes": arena.peak_bytes,
                                    "allocated_bytes": arena.allocated_bytes, "in_use_bytes": arena.in_use_bytes})
    result["selective_blocks"] = rt.selective_blocks
    setup = planner.Setup(precision="no", activation_checkpointing=True, checkpoint_level=rt.config.memory.checkpoint_level,
                          selective_blocks=None if rt.config.memory.selective_blocks == "fit" else rt.config.memory.selective_blocks,
                          offload_activations=True, batch=BATCH)
    shape = planner.ModelShape("offload-cases", CONFIG.vocab_size, CONFIG.dim, CONFIG.n_layers, CONFIG.n_heads,
                               CONFIG.n_kv_heads, CONFIG.ffn_dim, CONFIG.head_dim)
    planned = planner.estimate(shape, setup, SEQ)
    result["plan_selective_blocks"] = planned.setup.selective_blocks
    result["plan_host_bytes"] = planned.host_bytes

    # A forward that raises inside the model: nothing of the offload may stay behind.
    inner = model.layers[2]

    def boom(module, args, kwargs):
        raise RuntimeError("boom")

    handle = inner.register_forward_pre_hook(boom, with_kwargs=True)
    try:
        model(batches[STEPS])
        result["raised"] = False
    except RuntimeError as exc:
        result["raised"] = str(exc) == "boom"
    handle.remove()
    x, w = torch.randn(8, requires_grad=True), torch.randn(8)
    product = x * w  # autograd saves w: the same tensor, unless a saved-tensor hook was left pushed
    result["saved_outside_is_the_tensor"] = product.grad_fn._saved_other.data_ptr() == w.data_ptr()
    # ... and the next step is still the plain model's
    result["reference"].append(step(reference, ref_opt, batches[STEPS]))
    result["losses"].append(step(model, opt, batches[STEPS]))

    params = dict(reference.named_parameters())
    result["param_error"] = max((p.full_tensor() - params[n.replace("._checkpoint_wrapped_module", "")]).abs().max().item()
                                for n, p in model.named_parameters())
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
