"""How much GPU memory one training step takes, and how long a sequence fits: `cpctl plan`.

Pure arithmetic over a decoder's shape (no torch): a Llama block, and what the other families
add to it (Qwen2/3, Qwen3-MoE, Mistral, Mixtral, Gemma 2/3, Phi-3: `shapes.FAMILIES`). Each term
of the memory is one function in `terms.py`, in bytes per GPU, at each of the moments of a step
where the peak can fall:

* `loss`: the end of the forward, while the loss is differentiated, and the final norm's backward
  after it. With full logits this is nearly always the peak: every block's checkpoint is alive
  and so are the logits, their fp32 log-softmax and two fp32 gradients of that size. With the
  loss chunked, the final norm's fp32 backward can be the peak (in tiles, it is one tile's).
* `mlp_backward` / `attention_backward`: the first block's backward (the last layer), after
  its recompute: all checkpoints are still alive, plus the block's own working set, at its
  largest either in the MLP's backward or in attention's (where CP gathers K/V).
* `last_block_backward`: attention's backward in the last block of the backward (the first
  layer): the checkpoints are gone but the fp32 sharded gradients of every other block are
  there. The peak falls here when checkpoints do not hold GPU memory (offload_activations)
  or when the gradients outweigh them (few tokens, few shards).
* `optimizer_step`: sharded fp32 parameters, gradients and AdamW state, and the fp32
  temporary AdamW's foreach step makes.

The model is what `scripts/train_llama.py` and the README's loop do: FSDP2 over dp_shard x cp
(tensor parallelism splits the blocks), mixed precision (a block's parameters gathered in
bf16 while it runs, the root's embeddings and head gathered for the whole step), activation
checkpointing per block, AdamW, `optimizer.zero_grad(set_to_none=True)`, and the loss as
`F.cross_entropy(logits.float(), ...)` with `logits` held by the loop until backward ends
(or `model(labels=...).loss`, which holds them not), or a chunked loss (`rt.causal_lm_loss`).
With LoRA (`Setup.lora`, peft's adapters) the base is frozen in its own dtype: its weights are
sharded as parameters are but have no gradients, AdamW state or fp32 master copy; the fp32
adapters have all three, and add their own saved tensors to the activations, which the frozen
base still needs for the activations' gradients.
Calibration (tests/test_planner.py, docs/cli.md): the sum of the terms matches
torch.cuda.max_memory_allocated of 26 measured H200 runs, with and without the memory options,
within 2% (one within 5%).
What torch's peak does not count is added last: a fixed CUDA/NCCL overhead and the
allocator's headroom (memory it holds in blocks it cannot reuse).

Time: `timing.py` predicts a step's seconds by kernel class over a GPU's throughputs
(`hardware.py`: built-in H200/H100 figures, or `cpctl plan --calibrate`'s, which `calibration.py`
measures, the planner's one module that imports torch, and only when it runs); `ranking.py` ranks
the layouts that fit by it.

The modules, in the order they build on each other: `units` (GiB, dtype sizes, token lengths),
`shapes` (the model), `setup` (the profile's layout and memory options, LoRA), `terms` (the
memory, term by term), `fit` (whether it fits, how long a sequence does), `advice` (what to turn
on), `hardware` and `timing` (how long a step takes), `ranking` (the layouts that fit, fastest
first), `plan` (everything `cpctl plan` prints).
"""

from cpctl.planner.advice import Suggestion, option_names, suggestions
from cpctl.planner.fit import (
    ALLOCATOR_HEADROOM,
    CUDA_OVERHEAD_GIB,
    DEFAULT_GPU_MEMORY_GIB,
    MAX_GPUS,
    MAX_TOKENS,
    WORKER_HOST_GIB,
    Estimate,
    estimate,
    gpus_needed,
    longest_fitting,
    peak_gib,
)
from cpctl.planner.hardware import BUILT_IN, H100, H200, Throughputs, throughputs_for
from cpctl.planner.plan import GPU_COUNTS, Plan, all_free_options, make_plan
from cpctl.planner.ranking import Ranked, rank_layouts
from cpctl.planner.setup import (
    ALL_LINEAR,
    MEMORY_OPTIONS,
    Lora,
    ResolvedSetup,
    Setup,
    available_options,
    parse_lora,
    resolve_setup,
)
from cpctl.planner.shapes import PRESETS, PROJECTIONS, ModelShape, load_model, model_from_hf_config
from cpctl.planner.timing import StepTime, predict
from cpctl.planner.terms import BLOCK_MOMENTS, FP32, MOMENTS, TERMS, Sizes, Term, host_memory
from cpctl.planner.units import DTYPE_BYTES, GiB, format_tokens, parse_dtype, parse_number, parse_tokens

__all__ = [
    "ALLOCATOR_HEADROOM", "ALL_LINEAR", "BUILT_IN", "H100", "H200", "Ranked", "StepTime", "Throughputs", "predict",
    "rank_layouts", "throughputs_for", "BLOCK_MOMENTS", "CUDA_OVERHEAD_GIB", "DEFAULT_GPU_MEMORY_GIB", "DTYPE_BYTES", "FP32",
    "GPU_COUNTS", "GiB", "MAX_GPUS", "MAX_TOKENS", "MEMORY_OPTIONS", "MOMENTS", "PRESETS", "PROJECTIONS", "TERMS",
    "WORKER_HOST_GIB", "Estimate", "Lora", "ModelShape", "Plan", "ResolvedSetup", "Setup", "Sizes", "Suggestion", "Term",
    "all_free_options", "available_options", "estimate", "format_tokens", "gpus_needed", "host_memory", "load_model",
    "longest_fitting", "make_plan", "model_from_hf_config", "option_names", "parse_dtype", "parse_lora", "parse_number",
    "parse_tokens", "peak_gib", "resolve_setup", "suggestions",
]
