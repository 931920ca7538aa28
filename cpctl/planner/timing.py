"""How long one training step takes on one GPU of a layout: the model's work by kernel class, over
the throughputs of `hardware.py`.

The step is what the runtime runs (the memory terms in `terms.py` describe the same step):

* matmuls: every block's projections forward, again when checkpointing recomputes the block, and
  backward twice (the input's gradient, the weight's; a frozen LoRA base only the input's), an MLP
  in tiles once more (each tile recomputed in backward); the head forward and backward, and forward
  again in a chunked loss's backward.
* attention: 4 FLOPs per visible (query, key) pair per head dim per head forward, 2.5x that backward,
  and the forward again where checkpointing recomputes it (not at the selective level); the
  pairs are those of the mask (causal; sliding windows; packed documents), the rank's share of
  them (cp_load_balance evens the causal work; without it the last rank has the most); a kernel
  call of few queries (small chunks at large cp) runs below the long-call rate.
* the memory-bound rest: the eager elementwise kernels of a block (fp32 RMSNorm, rotary, residual
  adds, the gated activation, layout copies), counted in bytes each way, and the loss's softmax
  over the vocabulary; AdamW's step over the trained parameters.
* host launches: a block's forward, recompute and backward each cost a fixed host time; a mixture
  of experts' routing costs a fixed time per token and chosen expert.
* offload: saved activations to host and back, on the compute stream (not overlapped);
  `cpu_offload` moves parameters and gradients over PCIe and runs AdamW on the host.
* communication, only what is not hidden: FSDP's all-gathers and reduce-scatters are prefetched
  behind the blocks' matmuls; the all-gather strategy gathers K/V behind the local block; the
  ring sends the next K/V block while attending the current one; Ulysses' all-to-alls and
  tensor parallelism's all-reduces wait for nothing and hide behind nothing.

Checked against every step time measured on one and two H200s (tests/test_timing.py reads the
recorded rows of docs/benchmarks/*.jsonl).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from cpctl.errors import CpctlError
from cpctl.planner.hardware import Throughputs
from cpctl.planner.setup import Setup
from cpctl.planner.shapes import ModelShape
from cpctl.planner.terms import FP32, Sizes, offloaded_per_token, selective_layers
from cpctl.topology import sequence_chunks

BACKWARD_FLOPS = 2.5  # attention's backward over its forward (5 matmuls of the pairs against 2)
# Bytes an eager fp32 RMSNorm moves per element of model width in its forward (upcast, square,
# mean, scale, downcast, weight): about 8 passes of 4 bytes.
NORM_BYTES = 32
ADAMW_BYTES = 40  # per trained fp32 parameter: read weight, gradient, 2 states; write 3; foreach temporaries
# The loss's elementwise bytes per logit: softmax forward and backward over fp32 logits; a chunked
# loss recomputes the chunk's forward in backward.
LOSS_BYTES = {False: 30, True: 44}
SOFTCAP_BYTES = 16  # tanh forward and backward over the logits


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on one GPU, by component; the step is their sum."""

    seconds: dict[str, float] = field(default_factory=dict)
    tokens_per_step: int = 0  # over the whole world
    gpus: int = 1

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total

    def to_dict(self) -> dict[str, object]:
        return {"step_s": round(self.total, 3), "tokens_per_s": round(self.tokens_per_s),
                "tokens_per_s_per_gpu": round(self.tokens_per_s / self.gpus),
                "seconds": {name: round(value, 4) for name, value in self.seconds.items()}}


def visible_pairs(seq_len: int, *, window: int | None = None, document_tokens: int | None = None) -> float:
    """(query, key) pairs a causal mask lets through in one sequence, with a sliding window and/or
    packed documents of `document_tokens` each."""
    span = seq_len
    if document_tokens:
        span = min(span, document_tokens)
    pairs = seq_len * (span + 1) / 2  # causal within each span
    if window is not None and window < span:  # each query sees at most `window` keys
        pairs = seq_len * window - (seq_len // span) * window * (window - 1) / 2
    return pairs


def predict(model: ModelShape, setup: Setup, seq_len: int, figures: Throughputs, *,
            document_tokens: int | None = None) -> StepTime:
    """One step of `model` on `seq_len`-token sequences under `setup`, on GPUs of `figures`."""
    if seq_len < 1:
        raise CpctlError(f"sequence length must be at least 1 token, got {seq_len}")
    z = Sizes(model, setup, seq_len)
    compute = {"matmuls": _matmul_seconds(z, figures),
               "attention": _attention_seconds(z, figures, document_tokens),
               "memory-bound": _elementwise_bytes(z) / (figures.hbm_gbps * 1e9),
               "launches": _launch_seconds(z, figures), "expert routing": _routing_seconds(z, figures)}
    seconds = dict(compute)
    seconds.update(_offload_seconds(z, figures))
    seconds.update(_communication_seconds(z, figures, compute))
    replicas = max(1, setup.gpus // (setup.seq_ranks * setup.dp_shard * setup.tp)) * setup.dp_shard
    return StepTime({name: value for name, value in seconds.items() if value > 0},
                    tokens_per_step=setup.batch * seq_len * replicas, gpus=setup.gpus)


def attention_call_seconds(model: ModelShape, setup: Setup, seq_len: int, figures: Throughputs, *,
                           document_tokens: int | None = None) -> float:
    """One layer's attention forward and backward, nothing recomputed (what scripts/bench_attention.py
    times): the kernels, and the K/V exchange and all-to-alls compute does not hide."""
    z = Sizes(model, dataclasses.replace(setup, activation_checkpointing=False), seq_len)
    attention = _attention_seconds(z, figures, document_tokens)
    hidden = {"attention": attention, "matmuls": 0.0}
    exposed = _communication_seconds(z, figures, hidden)
    exposed.pop("FSDP, not hidden", None)  # no parameters in an attention call
    return (attention + sum(exposed.values())) / model.n_layers


# ------------------------------------------------------------------------------------------ compute


def _recomputes(z: Sizes) -> int:
    """Forwards of a block beyond the first: 1 with checkpointing (every level recomputes the projections)."""
    return 1 if z.setup.activation_checkpointing else 0


def _attention_recomputed(z: Sizes) -> int:
    """1 where checkpointing recomputes attention (and its exchange) in some block: not all selective."""
    return int(z.setup.activation_checkpointing and selective_layers(z) < z.model.n_layers)


def _matmul_seconds(z: Sizes, figures: Throughputs) -> float:
    """Dense projections at the matmul rate; a mixture of experts' grouped GEMMs at theirs."""
    experts = _expert_flops(z)
    return (_matmul_flops(z) - experts) / (figures.matmul_tflops * 1e12) + experts / (figures.grouped_matmul_tflops * 1e12)


def _expert_flops(z: Sizes) -> float:
    """The experts' share of `_matmul_flops`: each token's top-k experts, forward, recomputed, backward."""
    model, setup = z.model, z.setup
    if not model.experts:
        return 0.0
    per_token = model.active_expert_params / setup.tp
    forwards = 1 + _recomputes(z) + (1 if setup.tiled_mlp_tokens else 0)
    return (2 * forwards + (4 if setup.lora is None else 2)) * per_token * z.local_tokens


def _matmul_flops(z: Sizes) -> float:
    model, setup, tokens = z.model, z.setup, z.local_tokens
    blocks = (model.active_layers_params - model.n_layers * model.block_norms * model.dim) / setup.tp
    mlp = model.active_mlp_params / setup.tp
    forwards = 1 + _recomputes(z)
    backward = 4 if setup.lora is None else 2  # a frozen weight needs no gradient of its own
    adapters = z.adapter_params / setup.tp
    flops = (2 * forwards + backward) * blocks + (2 * forwards + 4) * adapters
    if setup.tiled_mlp_tokens:
        flops += 2 * mlp  # each tile's forward again in its backward
    head = model.vocab_size * model.dim
    head_backward = 4 if setup.lora is None or setup.chunked_loss else 2  # the chunked loss differentiates the weight
    flops += head * (2 + head_backward + (2 if setup.chunked_loss else 0))
    return flops * tokens


def _attention_pairs_per_rank(z: Sizes, document_tokens: int | None, *, windowed: bool) -> float:
    """Pairs the busiest rank attends, per sequence, per head."""
    setup, model = z.setup, z.model
    length = z.padded_seq_len
    pairs = visible_pairs(length, window=model.window if windowed else None, document_tokens=document_tokens)
    share = pairs / setup.seq_ranks
    if setup.cp > 1 and not setup.load_balance and not document_tokens and not windowed:
        share *= (2 * setup.cp - 1) / setup.cp  # the last of cp contiguous chunks sees the most keys
    return share


def _call_queries(z: Sizes, document_tokens: int | None) -> int:
    """Queries per attention kernel call: a ring chunk (Ulysses attends the cp rank's whole share), or a document."""
    queries = z.padded_seq_len // sequence_chunks(cp=z.setup.cp, load_balance=z.setup.load_balance)
    return max(1, min(queries, document_tokens or queries))


def _causal_share(z: Sizes) -> float:
    """The share of a rank's pairs in its one causal call over its own tokens (all of them at cp 1);
    the rest are rectangles against other ranks' K/V (no mask inside)."""
    own = z.local_tokens * z.setup.sp / z.setup.batch  # the cp rank's tokens, one sequence
    everything = visible_pairs(z.padded_seq_len) / z.setup.cp
    return min(1.0, own * (own + 1) / 2 / everything)


def _attention_seconds(z: Sizes, figures: Throughputs, document_tokens: int | None) -> float:
    model, setup = z.model, z.setup
    per_pair = 4 * model.head_dim * model.n_heads / setup.tp * setup.batch
    keys = min(z.padded_seq_len, document_tokens or z.padded_seq_len)  # what a long call's queries attend over
    recomputed = model.n_layers - selective_layers(z) if setup.activation_checkpointing else 0
    seconds = 0.0
    for windowed, layers in ((True, model.windowed_layers), (False, model.n_layers - model.windowed_layers)):
        if not layers:
            continue
        # a call is as short as its queries, or as the keys each of them sees (a window, a document)
        span = min(_call_queries(z, document_tokens), model.window if windowed and model.window else keys)
        efficiency = span / (span + figures.attention_half_rate_tokens)
        forward_rate = figures.attention_rate(model.head_dim, backward=False, keys=keys) * efficiency
        backward_rate = figures.attention_rate(model.head_dim, backward=True, keys=keys) * efficiency
        forward = per_pair * _attention_pairs_per_rank(z, document_tokens, windowed=windowed)
        if document_tokens or (windowed and model.window < z.padded_seq_len):  # the flash kernel, masked
            forward /= figures.masked_attention_share
        else:  # the pairs off the rank's own causal call are rectangles, which run faster
            forward /= 1 + (1 - _causal_share(z)) * (figures.rectangle_attention_gain - 1)
        layer = forward / forward_rate + BACKWARD_FLOPS * forward / backward_rate
        seconds += layers * layer + recomputed * (layers / model.n_layers) * forward / forward_rate
    return seconds


def _block_forward_bytes(z: Sizes) -> dict[str, float]:
    """Per local token, what one block's eager elementwise kernels move in its forward, by part."""
    model, act, tp = z.model, z.act, z.setup.tp
    heads = (model.q_dim + model.kv_dim) / tp
    attention = (2 * 3 * act * model.dim  # the residual adds
                 + 12 * act * heads  # rotary on q and k
                 + 4 * act * (model.q_dim + model.kv_dim) / tp  # q, k, v, out to and from the kernel's layout
                 + (NORM_BYTES * heads if model.qk_norm else 0))
    if z.setup.lora is not None:  # each adapter reads its projection's input and adds B(A x) to its output
        attention += _lora_bytes(z, model.attention_projections)
    if model.experts:  # the gated activation of each chosen expert, the tokens' copies to and from it, the router
        mlp = model.experts_per_token * (10 * act * model.expert_ffn_dim / tp + 4 * act * model.dim) + FP32 * model.experts * 3
    else:
        mlp = 10 * act * model.ffn_dim / tp
    if z.setup.lora is not None:
        mlp += _lora_bytes(z, model.mlp_projections)
    return {"norms": model.block_norms * NORM_BYTES * model.dim, "attention": attention, "mlp": mlp}


def _lora_bytes(z: Sizes, projections: dict[str, tuple[int, int]]) -> float:
    """Per token, what LoRA's adapters on these projections move: the input read again (and dropped out),
    B(A x) written, read and added to the projection's output (read and written)."""
    lora, act = z.setup.lora, z.act
    moved = 0.0
    for name in lora.targeted(projections):
        inputs, outputs = projections[name]
        moved += act * inputs * (3 if lora.dropout else 1) + 4 * act * outputs
    return moved / z.setup.tp


def _elementwise_bytes(z: Sizes) -> float:
    model, setup, tokens = z.model, z.setup, z.local_tokens
    parts = _block_forward_bytes(z)
    passes = 1 + _recomputes(z) + 2  # forward, recompute, backward (twice a forward's traffic)
    per_token = passes * sum(parts.values())
    if setup.tiled_mlp_tokens:
        per_token += parts["mlp"]
    if setup.tiled_norm_tokens:
        per_token += parts["norms"]
    logits = LOSS_BYTES[setup.chunked_loss] + (SOFTCAP_BYTES if model.logit_softcap is not None else 0)
    blocks = model.n_layers * per_token * tokens
    loss = logits * model.vocab_size * tokens
    optimizer = 0 if setup.cpu_offload else ADAMW_BYTES * z.trained_params_per_gpu
    return blocks + loss + optimizer


def _routing_seconds(z: Sizes, figures: Throughputs) -> float:
    model = z.model
    passes = 1 + _recomputes(z) + 2
    return model.moe_layers * model.experts_per_token * z.local_tokens * passes * figures.expert_dispatch_s


def _launch_seconds(z: Sizes, figures: Throughputs) -> float:
    passes = 1 + _recomputes(z) + 1
    return z.model.n_layers * passes * figures.block_launch_s


def _offload_seconds(z: Sizes, figures: Throughputs) -> dict[str, float]:
    setup, pcie = z.setup, figures.pcie_gbps * 1e9
    seconds = {}
    if setup.offload_activations and setup.activation_checkpointing:
        seconds["offload"] = 2 * offloaded_per_token(z) * z.local_tokens / pcie  # out in forward, back in backward
    if setup.cpu_offload:  # sharded fp32 parameters in at each all-gather (forward, backward), gradients out
        trained = z.trained_params_per_gpu
        seconds["cpu_offload"] = 3 * FP32 * z.params_per_gpu / pcie + trained / figures.host_adam_params_per_s
    return seconds


# ------------------------------------------------------------------------------------ communication


def _link_gbps(z: Sizes, figures: Throughputs, ranks: int) -> float:
    """The bandwidth of a group of `ranks` consecutive ranks: NVLink inside a node, else the network."""
    return figures.nvlink_gbps if ranks <= z.setup.gpus_per_node else figures.network_gbps


def _communication_seconds(z: Sizes, figures: Throughputs, compute: dict[str, float]) -> dict[str, float]:
    model, setup, tokens, act = z.model, z.setup, z.local_tokens, z.act
    seconds: dict[str, float] = {}
    shards = z.shards
    if shards > 1 or setup.gpus > setup.seq_ranks * setup.dp_shard * setup.tp:
        # FSDP: a block's parameters gathered in forward and in backward, gradients reduce-scattered (fp32)
        gathered = 2 * act * (model.params / setup.tp) * (shards - 1) / shards
        reduced = FP32 * (z.trained_params_per_gpu * shards) * (shards - 1) / shards
        replicas = setup.gpus // (shards * setup.tp)
        if replicas > 1:  # dp_replicate: the shards' gradients all-reduced across replicas
            reduced += 2 * FP32 * z.trained_params_per_gpu * (replicas - 1) / replicas
        busy = (gathered + reduced) / (_link_gbps(z, figures, setup.gpus) * 1e9)
        seconds["FSDP, not hidden"] = max(0.0, busy - compute["matmuls"])
    if setup.cp > 1:
        seconds["CP K/V, not hidden"] = _cp_exposed(z, figures, compute)
    if setup.sp > 1:  # q, k, v and out each way in forward and in backward, again when recomputed
        per_call = act * (2 * model.q_dim + 2 * model.kv_dim * z.kv_copies) / setup.tp * tokens * (setup.sp - 1) / setup.sp
        calls = 2 + _attention_recomputed(z)
        seconds["Ulysses all-to-all"] = model.n_layers * calls * per_call / (figures.nvlink_gbps * 1e9)
    if setup.tp > 1:  # two all-reduces of the hidden states per block and pass
        per_pass = 2 * 2 * act * model.dim * tokens * (setup.tp - 1) / setup.tp
        seconds["TP all-reduce"] = model.n_layers * (2 + _recomputes(z)) * per_pass / (figures.nvlink_gbps * 1e9)
    return seconds


def _cp_exposed(z: Sizes, figures: Throughputs, compute: dict[str, float]) -> float:
    """K/V exchange of the ring group that compute does not hide, per step."""
    model, setup, act = z.model, z.setup, z.act
    cp = setup.cp
    link = _link_gbps(z, figures, setup.seq_ranks * setup.tp) * 1e9  # the ranks of one sequence, tp innermost
    cp_rank_tokens = z.local_tokens * setup.sp  # what one cp rank holds, before Ulysses splits it
    kv = 2 * act * model.kv_dim * z.kv_copies / (setup.tp * setup.sp) * cp_rank_tokens  # one rank's K and V
    attention_per_layer = compute["attention"] / model.n_layers
    recomputed = _attention_recomputed(z)
    # forward (and its recompute): K/V in; backward: K/V in, and their fp32 gradients out
    volume = kv * (1 + recomputed + 1) + 2 * kv * 2
    if setup.strategy == "allgather":
        busy = volume * (cp - 1) / link
        local = attention_per_layer / cp  # the block of the rank's own K/V, computed while the rest arrive
        return model.n_layers * max(0.0, busy - local)
    step = volume / link  # one neighbour's block per ring step, while attending the current one
    block = attention_per_layer / cp
    return model.n_layers * (cp - 1) * max(0.0, step - block)
