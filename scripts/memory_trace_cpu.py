"""Which tensors are alive at the peak of a training step, on CPU: a planner term's check without a GPU.

A TorchDispatchMode sees every tensor an op returns; it counts each storage once (views share
it) from the op that made it until it is freed, and keeps the peak of the live bytes and what
was alive then: each tensor's shape, dtype, the op that made it and where (the module whose
forward or recompute ran, or the autograd node whose backward did). Parameters made before the
trace are not counted; everything else (activations, checkpoints, gradients, working sets) is.

The step is what `cpctl launch --activation-checkpointing true --chunked-loss ...` runs on a
Hugging Face LlamaForCausalLM at world 1, in bf16: each decoder layer under a non-reentrant
checkpoint (cpctl's own wrapper), the MLPs and optionally the norms in tiles
(cpctl.runtime.tiling), the loss chunked (cpctl.runtime.losses). Not modelled: FSDP (its
gathered parameters and fp32 gradients are parameter-sized), offload_activations (CUDA only:
here every block's input stays, a separate term).

    PYTHONPATH=$PWD python scripts/memory_trace_cpu.py --seq 8192 --tiled-norm-tokens 0
    PYTHONPATH=$PWD python scripts/memory_trace_cpu.py --seq 8192 --tiled-norm-tokens 1024

prints the peak, the live tensors at it grouped by where they were made, the peak of each
backward phase, and the planner's terms for the same shape (scaled to this model).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MiB = 2**20


@dataclasses.dataclass
class Live:
    ref: StorageWeakRef
    nbytes: int
    what: str  # shape, dtype
    op: str
    where: str


class LiveTensors(TorchDispatchMode):
    """The bytes of live tensor storages, their peak, and a snapshot of them at the peak."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self.live: dict[int, Live] = {}
        self.total = self.peak = 0
        self.at_peak: list[Live] = []
        self.peak_where = ""
        self.where = "forward"
        self.phase_peaks: dict[str, int] = collections.defaultdict(int)
        self.phase_snapshots: dict[str, list[Live]] = {}
        self.ignored: set[int] = set()  # storages made before the trace (parameters): not counted

    def ignore(self, tensors) -> None:
        self.ignored.update(tensor.untyped_storage().data_ptr() for tensor in tensors)

    backward = False

    def enter(self, name: str) -> None:
        self.where = ("recompute " if self.backward else "") + name

    def _sweep(self) -> None:
        for key in [key for key, entry in self.live.items() if entry.ref.expired()]:
            self.total -= self.live.pop(key).nbytes

    def _place(self) -> str:
        node = torch._C._current_autograd_node()
        return f"{self.where} / backward {node.name()}" if node is not None else self.where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != self.device:
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in self.live or key in self.ignored:
                continue
            shape = f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
            self.live[key] = Live(StorageWeakRef(storage), storage.nbytes(), shape, str(func.overloadpacket.__name__),
                                  self._place())
            self.total += storage.nbytes()
        place = self._place()
        if self.total > self.phase_peaks[self.where]:
            self.phase_peaks[self.where] = self.total
            self.phase_snapshots[self.where] = list(self.live.values())
        if self.total > self.peak:
            self.peak, self.peak_where = self.total, place
            self.at_peak = list(self.live.values())
        return out


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    from cpctl.runtime import tiling
    from cpctl.runtime.parallelize import apply_activation_checkpointing

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.seq, attn_implementation="sdpa", use_cache=False,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    blocks = list(model.model.layers)
    if args.tiled_mlp_tokens:
        tiling.apply_tiled_mlp(blocks, tile_tokens=args.tiled_mlp_tokens)
    if args.tiled_norm_tokens:
        tiling.apply_tiled_norms(blocks, tile_tokens=args.tiled_norm_tokens, model=model)
    apply_activation_checkpointing(blocks, model, contexts=lambda index: (contextlib.nullcontext(), contextlib.nullcontext()))
    if args.offload_activations:  # CUDA only, as in cpctl: what the model's forward saves goes to host memory
        from cpctl.runtime.pinned import HostArena, offload_saved_activations

        offload_saved_activations(model, arena=HostArena(torch.device(args.device)))
    return model


def label_phases(model, tracker: LiveTensors) -> None:
    """The place a tensor is made: the last module whose forward (or recompute) began."""
    for name, module in model.named_modules():
        if name.endswith(("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")) or name in ("model.norm", "model.embed_tokens"):
            short = name.replace("._checkpoint_wrapped_module", "")
            module.register_forward_pre_hook(lambda module, inputs, short=short: tracker.enter(short))
            module.register_forward_hook(lambda module, inputs, output, short=short: tracker.enter(short + " (after)"))


def step(model, ids, *, chunk_tokens: int, tracker: LiveTensors) -> None:
    from cpctl.runtime.losses import chunked_linear_cross_entropy

    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    captured = []  # the final hidden states, as rt.causal_lm_loss takes them: the decoder's output
    hook = model.model.register_forward_hook(lambda module, args, output: captured.append(output.last_hidden_state))
    model(input_ids=ids, position_ids=positions, logits_to_keep=1)
    hook.remove()
    hidden = captured.pop()
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    tracker.where = "loss"
    loss = chunked_linear_cross_entropy(hidden, model.lm_head.weight, labels, chunk_tokens=chunk_tokens)
    del hidden
    tracker.where, tracker.backward = "backward: loss", True
    loss.backward()


def planner_terms(args) -> str:
    from cpctl import planner

    shape = planner.ModelShape(name="traced", dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                               n_kv_heads=args.kv_heads, ffn_dim=args.ffn, vocab_size=args.vocab,
                               head_dim=args.dim // args.heads)
    setup = planner.Setup(activation_checkpointing=True, chunked_loss=True, tiled_mlp_tokens=args.tiled_mlp_tokens,
                          tiled_norm_tokens=args.tiled_norm_tokens, loss_chunk_tokens=args.chunk_tokens, first_step=True,
                          precision="bf16")
    estimate = planner.estimate(shape, setup, args.seq)
    rows = [f"  {'term':28s}" + "".join(f"{m[:14]:>16s}" for m in planner.MOMENTS)]
    for term in estimate.terms:
        rows.append(f"  {term.name:28s}" + "".join(f"{term.at[m] / MiB:16.1f}" for m in planner.MOMENTS))
    rows.append(f"  {'total':28s}" + "".join(f"{estimate.total(m) / MiB:16.1f}" for m in planner.MOMENTS))
    return "\n".join(rows)


def print_live(title: str, entries: list[Live], *, top: int) -> None:
    groups: dict[tuple[str, str, str], list[int]] = collections.defaultdict(list)
    for entry in entries:
        groups[(entry.where, entry.op, entry.what)].append(entry.nbytes)
    print(f"{title}, largest first (MiB, count x shape dtype, op, where made):")
    for (where, op, what), sizes in sorted(groups.items(), key=lambda item: -sum(item[1]))[:top]:
        print(f"  {sum(sizes) / MiB:8.1f}  {len(sizes):3d} x {what:22s} {op:26s} {where}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("dim", 256), ("layers", 4), ("ffn", 1024), ("heads", 8), ("kv-heads", 2), ("vocab", 4096),
                          ("seq", 8192), ("tiled-mlp-tokens", 1024), ("tiled-norm-tokens", 0), ("chunk-tokens", 1024),
                          ("top", 40)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--offload-activations", action="store_true", help="cpctl's offload of saved activations (cuda)")
    parser.add_argument("--show", action="append", help="also list what is live at the peak of this place (repeatable)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    model = build(args)
    tracker = LiveTensors(args.device)
    tracker.ignore([*model.parameters(), *model.buffers()])
    label_phases(model, tracker)
    ids = torch.randint(0, args.vocab, (1, args.seq), device=args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with tracker:
        step(model, ids, chunk_tokens=args.chunk_tokens, tracker=tracker)
    width = args.seq * args.dim
    print(f"peak {tracker.peak / MiB:.1f} MiB at {tracker.peak_where}  "
          f"(one bf16 tensor of tokens x dim = {2 * width / MiB:.1f} MiB, fp32 {4 * width / MiB:.1f} MiB)")
    if args.device == "cuda":
        print(f"torch.cuda.max_memory_allocated beyond the parameters: {(torch.cuda.max_memory_allocated() - base) / MiB:.1f} MiB")
    print_live("live at the peak", tracker.at_peak, top=args.top)
    print("peak of the live bytes while each place ran (MiB; 'recompute X': X's recompute and the backward after it):")
    for where, peak in tracker.phase_peaks.items():
        print(f"  {peak / MiB:8.1f}  {where}")
    for where in args.show or []:
        print_live(f"live at the peak of {where!r} ({tracker.phase_peaks[where] / MiB:.1f} MiB)",
                   tracker.phase_snapshots[where], top=args.top)
    print("the planner's terms for this shape and setup (MiB; parameters are not traced above):")
    print(planner_terms(args))


if __name__ == "__main__":
    main()
