"""Worker for tests/test_runtime.py: the runtime API (docs/runtime.md), measured in real processes.

    cpctl launch --device cpu --nproc-per-node 2 --cp-size 2 tests/workers/runtime_cases.py OUT.json
    python tests/workers/runtime_cases.py OUT.json        # a world of one: cp 1, nothing sharded

Every rank runs every case (cases use collectives, so all ranks must take the same path); a case
records plain numbers and messages, or the traceback it died with, and the next case still runs.
Rank 0 writes {"world": N, "ranks": [{case: result}, ...]} to OUT.json. The assertions live
in the test; this file only measures, against references computed the simple way (one
process, the full sequence).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as sdpa_by_name  # imported by name on purpose

import cpctl
from cpctl.attention import ChunkLayout, context_parallel_attention, shard
from cpctl.runtime.runtime import Runtime, step_context


def randn(seed: int, *shape: int) -> torch.Tensor:
    """The same tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.detach().double() - b.detach().double()).abs().max().item()


def variant(rt: Runtime, **parallelism) -> Runtime:
    """A second Runtime on the same mesh with other CP settings (strategy, load balance)."""
    config = dataclasses.replace(rt.config, parallelism=dataclasses.replace(rt.config.parallelism, **parallelism))
    return Runtime(config, step_context(rt).mesh, rt.device)


def error_of(action) -> dict:
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - the type is what the test checks
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": None}


def entering(runtime: Runtime, **context) -> Callable[[], None]:
    """An action that enters and leaves maybe_context_parallel(**context) with an empty body."""
    def run():
        with runtime.maybe_context_parallel(**context):
            pass
    return run


class TinyBlock(nn.Module):
    def __init__(self, *, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, self.head_dim).transpose(1, 2).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=1)
        att = sdpa_by_name(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.out(att.transpose(1, 2).reshape(b, s, -1))


class TinyLM(nn.Module):
    """Embeddings indexed by true positions, GQA attention through SDPA (imported by name), a head."""

    def __init__(self, *, vocab: int = 32, dim: int = 16, heads: int = 4, kv_heads: int = 2, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(64, dim)
        self.layers = nn.ModuleList(TinyBlock(dim=dim, heads=heads, kv_heads=kv_heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos(position_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# ---------------------------------------------------------------------------------------- cases


def case_attributes(rt: Runtime) -> dict:
    flattened = {}
    for name in ("dp", "dp_shard_cp", "dp_cp"):
        try:
            flattened[name] = rt.mesh[name].size()
        except Exception as exc:  # noqa: BLE001
            flattened[name] = f"{type(exc).__name__}: {exc}"
    return {
        "rank": rt.rank, "world_size": rt.world_size, "cp_size": rt.cp_size, "cp_rank": rt.cp_rank,
        "dp_size": rt.dp_size, "dp_rank": rt.dp_rank, "is_main": rt.is_main, "device": str(rt.device),
        "config_cp_size": rt.config.parallelism.cp_size, "strategy": rt.config.parallelism.cp_comm_strategy,
        "load_balance": rt.config.parallelism.cp_load_balance,
        "mesh_dim_names": list(rt.mesh.mesh_dim_names), "mesh_shape": list(rt.mesh.shape),
        "flattened_sizes": flattened,
        "init_again_is_same": cpctl.init() is rt,
    }


def case_bad_inputs(rt: Runtime) -> dict:
    rt_plain = variant(rt, cp_load_balance=False)
    q = randn(1, 1, 4, 4, 8)  # a (batch, heads, local seq 4, head_dim) shard: S = 8 for cp 2
    ids = torch.arange(8).view(1, 8)
    results: dict[str, dict] = {}

    def inside(action, *, runtime=rt):
        def run():
            with runtime.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1]):
                action()
        return run

    local = q.shape[2]
    padding_mask = torch.ones(local, local, dtype=torch.bool).tril()
    padding_mask[:, 0] = False  # a left-padded row: not plain causal attention
    # the functional path shards what it is given (maybe_context_parallel pads such lengths: test_row_ends.py)
    results["seq_len_load_balance"] = error_of(lambda: rt.shard(torch.arange(6).view(1, 6), seq_dim=1))
    results["seq_len_no_balance"] = error_of(lambda: rt_plain.shard(torch.arange(5).view(1, 5), seq_dim=1))
    results["sdpa_full_mask"] = error_of(inside(lambda: F.scaled_dot_product_attention(
        q, q, q, attn_mask=torch.ones(local, local, dtype=torch.bool))))
    results["sdpa_padding_mask"] = error_of(inside(lambda: F.scaled_dot_product_attention(
        q, q, q, attn_mask=padding_mask)))
    results["sdpa_additive_window_mask"] = error_of(inside(lambda: F.scaled_dot_product_attention(
        q, q, q, attn_mask=torch.zeros(local, local).masked_fill(
            ~torch.ones(local, local, dtype=torch.bool).tril().triu(-1), float("-inf")))))
    results["sdpa_dropout"] = error_of(inside(lambda: F.scaled_dot_product_attention(
        q, q, q, dropout_p=0.1, is_causal=True)))
    results["no_restore_not_subset"] = error_of(
        entering(rt, buffers=[ids], buffer_seq_dims=[1], no_restore_buffers={torch.arange(8).view(1, 8)}))
    results["buffer_requires_grad"] = error_of(
        entering(rt, buffers=[ids, torch.zeros(1, 8, requires_grad=True)], buffer_seq_dims=[1, 1]))
    results["buffers_vs_seq_dims"] = error_of(entering(rt, buffers=[ids, ids.clone()], buffer_seq_dims=[1]))
    results["gqa_without_enable_gqa"] = error_of(lambda: rt.attention(q, q[:, :2], q[:, :2], is_causal=True))
    results["duplicate_buffer"] = error_of(entering(rt, buffers=[ids, ids], buffer_seq_dims=[1, 1]))
    fsdp1 = dataclasses.replace(rt.config, fsdp=dataclasses.replace(rt.config.fsdp, version=1))
    results["fsdp_version_1"] = error_of(lambda: Runtime(fsdp1, step_context(rt).mesh,
                                                         rt.device).prepare_model(torch.nn.Linear(2, 2)))
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = randn(2, 1, 4, 8)
    results["mha_need_weights"] = error_of(inside(lambda: mha(x, x, x, need_weights=True)))
    results["documents_wrong_length"] = error_of(
        entering(rt, buffers=[ids.clone()], buffer_seq_dims=[1], documents=torch.arange(6).view(1, 6)))
    results["documents_not_tensor"] = error_of(
        entering(rt, buffers=[ids.clone()], buffer_seq_dims=[1], documents=[[4, 4]]))
    results["ids_after_errors"] = ids.tolist()  # errors inside the context still restore the buffers

    # A rejected call leaves no buffer half-sharded: the good first buffer keeps its full length.
    good = torch.arange(8).view(1, 8)
    results["mixed_lengths"] = error_of(
        entering(rt, buffers=[good, torch.arange(6).view(1, 6)], buffer_seq_dims=[1, 1]))
    results["good_buffer_after_mixed_lengths"] = good.tolist()
    return results


def case_causal_mask_accepted(rt: Runtime) -> dict:
    """A Hugging Face style explicit causal mask (bool or additive) means is_causal=True."""
    b, h, s, d = 2, 4, 16, 8
    q, k, v = (randn(seed, b, h, s, d) for seed in (10, 11, 12))
    reference = rt.shard(F.scaled_dot_product_attention(q, k, v, is_causal=True), 2)
    ids = torch.zeros(b, s, dtype=torch.long)
    local = s // rt.cp_size
    tril = torch.ones(local, local, dtype=torch.bool).tril()
    additive = torch.zeros(b, 1, local, local).masked_fill(~tril, torch.finfo(torch.float32).min)
    qs, ks, vs = (rt.shard(t, 2) for t in (q, k, v))
    with rt.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1]):
        causal = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        with_bool = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=tril)
        with_additive = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=additive)
    return {"causal_vs_reference": max_err(causal, reference), "bool_vs_causal": max_err(with_bool, causal),
            "additive_vs_causal": max_err(with_additive, causal)}


def case_buffers(rt: Runtime) -> dict:
    ids = torch.arange(16).view(2, 8)  # row r holds 8r .. 8r+7
    feats = torch.arange(48, dtype=torch.float32).view(2, 3, 8)  # sequence along dim 2
    pos = cpctl.position_ids_like(ids)
    ids_storage = ids.untyped_storage().data_ptr()
    with rt.maybe_context_parallel(buffers=[ids, feats, pos], buffer_seq_dims=[1, -1, 1], no_restore_buffers={pos}):
        inside = {"ids": ids.tolist(), "feats": feats.tolist(), "pos": pos.tolist()}
    return {
        "inside": inside,
        "after": {"ids": ids.tolist(), "feats": feats.tolist(), "pos": pos.tolist()},
        "ids_storage_back": ids.untyped_storage().data_ptr() == ids_storage,
    }


def case_shard_unshard(rt: Runtime) -> dict:
    x = randn(20, 2, 8, 3)
    tokens = torch.arange(16).view(2, 8)
    y = randn(21, 2, 3, 8)
    shard_y = rt.shard(y, -1)
    return {
        "roundtrip_dim1": max_err(rt.unshard(rt.shard(x, 1), 1), x),
        "roundtrip_last_dim": max_err(rt.unshard(shard_y, -1), y),
        "shard_tokens": rt.shard(tokens, 1).tolist(),
        "tokens_untouched": tokens.tolist() == torch.arange(16).view(2, 8).tolist(),
        "shard_is_new_tensor": rt.cp_size == 1 or shard_y.untyped_storage().data_ptr() != y.untyped_storage().data_ptr(),
    }


def case_step_state(rt: Runtime) -> dict:
    """A step's layout, padding and documents are the step's: after its context (left normally or
    by an error) shards, gathers and the layout are the plain ones again, and the step it yielded
    still gathers its own results."""
    def tokens(n: int) -> torch.Tensor:
        return torch.arange(n).view(1, n)

    plain = rt.shard(tokens(32), 1).tolist()
    pos = cpctl.position_ids_for_documents([[25, 3, 2, 2]])  # long-tailed: placed by cost, not head-tail
    ids = tokens(32)
    with rt.maybe_context_parallel(buffers=[ids, pos], buffer_seq_dims=[1, 1], no_restore_buffers={pos},
                                   documents=pos.clone()) as step:
        inside = {"shard": rt.shard(tokens(32), 1).tolist(), "active": step_context(rt).cp_active}
        result = ids * 2  # a result of the step, sharded as the step placed its tokens
    after = {"shard": rt.shard(tokens(32), 1).tolist(), "active": step_context(rt).cp_active, "balance": rt.cp_balance,
             "local_chunks": list(rt.layout.local_chunks), "ids_restored": ids.tolist() == tokens(32).tolist(),
             "step_unshard": None if step is None else step.unshard(result, seq_dim=1).tolist(),
             "rt_unshard": error_of(lambda: rt.unshard(result, 1)),
             "rt_shift_sharded": error_of(lambda: rt.shift_sharded(result))}
    # 30 tokens are padded to 32; the body fails: everything the step set goes with it.
    ids = tokens(30)

    def failing() -> None:
        with rt.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1],
                                       documents=cpctl.position_ids_for_documents([[25, 5]])):
            raise RuntimeError("the body failed")

    raised = error_of(failing)
    after_error = {"raised": raised["message"], "padding": None if rt.padding is None else rt.padding.describe(),
                   "active": step_context(rt).cp_active, "shard": rt.shard(tokens(32), 1).tolist(),
                   "ids_restored": ids.tolist() == tokens(30).tolist(), "appended": step_context(rt).appended_in_shard(16) is not None}
    # Labels kept sharded after a padded step are still checked against the tokens it appended.
    labels = tokens(30)  # no -100 anywhere: the appended labels repeat the last one
    with rt.maybe_context_parallel(buffers=[labels], buffer_seq_dims=[1], no_restore_buffers={labels}):
        pass
    counted_tail = error_of(lambda: rt.token_mean(torch.tensor(1.0), labels))
    # A plain step's results are gathered by rt.unshard after the context, as ever.
    ids = tokens(32)
    with rt.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1]):
        result = ids * 3
    return {"plain": plain, "inside": inside, "after": after, "after_error": after_error,
            "counted_tail": counted_tail, "plain_step_unshard": rt.unshard(result, 1).tolist()}


def case_functional_attention(rt: Runtime) -> dict:
    """rt.attention on rt.shard-ed q/k/v = the shards of full SDPA, forward and backward."""
    results = {}
    runtimes = {"allgather_balanced": rt, "alltoall_plain": variant(rt, cp_comm_strategy="alltoall", cp_load_balance=False),
                "alltoall_balanced": variant(rt, cp_comm_strategy="alltoall")}
    for label, runtime in runtimes.items():
        for causal in (True, False):
            for q_heads, kv_heads in ((4, 4), (4, 2), (4, 1)):
                b, s, d = 2, 16, 8
                q, dout = randn(30, b, q_heads, s, d), randn(31, b, q_heads, s, d)
                k, v = randn(32, b, kv_heads, s, d), randn(33, b, kv_heads, s, d)
                gqa = q_heads != kv_heads
                full = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=gqa)
                ref.backward(dout)
                local = [runtime.shard(t, 2).requires_grad_() for t in (q, k, v)]
                out = runtime.attention(*local, is_causal=causal, enable_gqa=gqa)
                out.backward(runtime.shard(dout, 2))
                errors = {"out": max_err(out, runtime.shard(ref, 2)),
                          "unshard(out)": max_err(runtime.unshard(out, 2), ref)}  # out is seq-major, not contiguous
                for name, mine, theirs in zip("qkv", local, full):
                    errors[f"d{name}"] = max_err(mine.grad, runtime.shard(theirs.grad, 2))
                results[f"{label}/causal={causal}/heads={q_heads}:{kv_heads}"] = errors
    return results


def case_model_in_context(rt: Runtime) -> dict:
    """A user model's SDPA inside the context gives, once unsharded, the full-sequence logits."""
    torch.manual_seed(0)
    model = TinyLM()
    ids_full = torch.randint(32, (2, 16), generator=torch.Generator().manual_seed(40))
    reference = model(ids_full, cpctl.position_ids_like(ids_full))
    results = {}
    for label, runtime in (("rt", rt), ("alltoall_plain", variant(rt, cp_comm_strategy="alltoall", cp_load_balance=False)),
                           ("rt_again", rt)):
        ids, pos = ids_full.clone(), cpctl.position_ids_like(ids_full)
        with runtime.maybe_context_parallel(buffers=[ids, pos], buffer_seq_dims=[1, 1], no_restore_buffers={ids, pos}):
            logits = model(ids, pos)
        results[label] = {"error": max_err(runtime.unshard(logits, 1), reference), "local_len": logits.shape[1]}
    # Outside the context SDPA is plain again: the full sequence, unsharded.
    results["after_exit"] = max_err(model(ids_full, cpctl.position_ids_like(ids_full)), reference)
    return results


def case_token_mean(rt: Runtime) -> dict:
    b, s = 2, 16
    per_token = randn(50, b, s).abs()
    labels = cpctl.shift_labels(torch.randint(32, (b, s), generator=torch.Generator().manual_seed(51)))
    labels[0, :5] = -100  # the first chunk's owner has fewer tokens: weighting by tokens matters
    kept = labels != -100
    expected = (per_token * kept).sum() / kept.sum()
    weight = torch.ones((), requires_grad=True)
    with rt.maybe_context_parallel(buffers=[labels, per_token], buffer_seq_dims=[1, 1],
                                   no_restore_buffers={labels, per_token}):
        loss_sum = (weight * per_token * (labels != -100)).sum()
        loss = rt.token_mean(loss_sum, labels)
        loss.backward()
    return {"value": loss.item(), "expected": expected.item(), "local_tokens": int((labels != -100).sum()),
            "weight_grad": weight.grad.item(), "averaging": rt.axes["dp_cp"].size()}


def case_fsdp_gradients(rt: Runtime) -> dict:
    """prepare_model + context + token_mean + backward = single-process gradients of the token mean."""
    torch.manual_seed(1)
    model = TinyLM()
    reference_model = copy.deepcopy(model)
    ids_full = torch.randint(32, (2, 16), generator=torch.Generator().manual_seed(60))
    labels_full = cpctl.shift_labels(ids_full)
    labels_full[1, :6] = -100
    ref_loss = F.cross_entropy(reference_model(ids_full, cpctl.position_ids_like(ids_full)).flatten(0, 1),
                               labels_full.flatten(), ignore_index=-100)
    ref_loss.backward()
    model = rt.prepare_model(model)
    ids, labels, pos = ids_full.clone(), labels_full.clone(), cpctl.position_ids_like(ids_full)
    with rt.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                   no_restore_buffers={ids, labels, pos}):
        logits = model(ids, pos)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        loss = rt.token_mean(loss_sum, labels)
        loss.backward()
    reference_grads = dict(reference_model.named_parameters())
    errors, largest = {}, 0.0
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        errors[name] = max_err(grad, reference_grads[name].grad)
        largest = max(largest, reference_grads[name].grad.abs().max().item())
    return {"loss": loss.item(), "reference_loss": ref_loss.item(), "grad_errors": errors,
            "largest_grad": largest, "num_params": len(reference_grads)}


def case_two_groups(rt: Runtime) -> dict:
    """Two CP groups and layouts in one process, their calls interleaved: both stay right."""
    other_group = dist.new_group(list(range(dist.get_world_size())))
    rank, world = dist.get_rank(), dist.get_world_size()
    setups = {
        "world_balanced_allgather": (dist.group.WORLD, ChunkLayout(cp_size=world, cp_rank=rank, load_balance=True), "allgather"),
        "new_group_plain_alltoall": (other_group, ChunkLayout(cp_size=world, cp_rank=rank, load_balance=False), "alltoall"),
        "new_group_balanced_alltoall": (other_group, ChunkLayout(cp_size=world, cp_rank=rank, load_balance=True), "alltoall"),
    }
    b, h, s, d = 1, 4, 16, 8
    q, k, v, dout = (randn(seed, b, h, s, d) for seed in (70, 71, 72, 73))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True)
    ref.backward(dout)
    pending = {}
    for label, (group, layout, strategy) in setups.items():  # every forward first ...
        local = [shard(t, seq_dim=2, layout=layout).requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*local, group=group, layout=layout, strategy=strategy, is_causal=True)
        pending[label] = (layout, local, out)
    results = {}
    for label, (layout, local, out) in reversed(pending.items()):  # ... then the backwards, in reverse
        out.backward(shard(dout, seq_dim=2, layout=layout))
        errors = {"out": max_err(out, shard(ref, seq_dim=2, layout=layout))}
        for name, mine, theirs in zip("qkv", local, full):
            errors[f"d{name}"] = max_err(mine.grad, shard(theirs.grad, seq_dim=2, layout=layout))
        results[label] = errors
    return results


def case_dataloader(rt: Runtime) -> dict:
    data = [{"index": i} for i in range(8)]
    loader = rt.prepare_dataloader(data, batch_size=2, shuffle=True)
    epochs = [[batch["index"].tolist() for batch in loader] for _ in range(2)]
    return {"batches": epochs[0], "second_epoch": epochs[1]}


def case_multihead_attention(rt: Runtime) -> dict:
    """nn.MultiheadAttention and nn.TransformerEncoderLayer (no SDPA call of their own to see)."""
    torch.manual_seed(5)
    results = {}
    modules = {
        "mha_train": torch.nn.MultiheadAttention(16, 2, batch_first=True).train(),
        "mha_eval": torch.nn.MultiheadAttention(16, 2, batch_first=True).eval(),
        "encoder_layer_eval": torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval(),
    }
    for label, module in modules.items():
        x = randn(90, 2, 8, 16)

        def run(inputs):
            out = module(inputs, inputs, inputs, need_weights=False) if "mha" in label else module(inputs)
            return out[0] if isinstance(out, tuple) else out

        reference, local = run(x), x.clone()
        with rt.maybe_context_parallel(buffers=[local], buffer_seq_dims=[1]):
            results[label] = max_err(rt.unshard(run(local).detach(), 1), reference)
    return results


def case_single_process(rt: Runtime) -> dict:
    """World of one (cp 1): the context shards nothing (the shard is the whole sequence), and
    attention inside it goes through the CP engine over a group of one."""
    ids = torch.arange(7).view(1, 7)  # 7 is odd: there is nothing to divide at cp 1
    storage = ids.untyped_storage().data_ptr()
    q, k, v = (randn(seed, 1, 2, 7, 8) for seed in (80, 81, 82))
    window = torch.ones(7, 7, dtype=torch.bool).tril().triu(-1)  # a mask CP would reject
    outside = F.scaled_dot_product_attention(q, k, v, attn_mask=window)
    causal_outside = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    calls = step_context(rt).attention_calls
    with rt.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1], no_restore_buffers={ids}):
        inside_ids = ids.tolist()
        inside = F.scaled_dot_product_attention(q, k, v, attn_mask=window)  # runs as it is: nothing sharded
        causal_inside = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # through the engine
        loss = rt.token_mean(torch.tensor(20.0), torch.tensor([[1, 2, -100, 3, 4, 5, -100]]))
    engine_calls = step_context(rt).attention_calls - calls
    documents = cpctl.position_ids_for_documents([[3, 4]])
    with rt.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1], documents=documents):
        packed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        masked_with_documents = error_of(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=window))
    one_by_one = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
                            for a, b in ((0, 3), (3, 7))], dim=2)
    return {
        "inside_ids": inside_ids, "same_storage": ids.untyped_storage().data_ptr() == storage,
        "masked_sdpa_error": max_err(inside, outside), "token_mean": loss.item(),
        "causal_sdpa_error": max_err(causal_inside, causal_outside), "engine_calls": engine_calls,
        "documents_error": max_err(packed, one_by_one), "masked_with_documents": masked_with_documents,
        "shard_is_identity": rt.shard(q, 2) is q, "unshard_is_identity": rt.unshard(q, 2) is q,
        "attention_error": max_err(rt.attention(q, k, v, is_causal=True), causal_outside),
    }


def case_misuse(rt: Runtime) -> dict:
    """Mistakes that used to give a bare torch error, a hang or a silently wrong answer."""
    results: dict[str, dict] = {}
    ids = torch.arange(16).view(2, 8)
    labels = cpctl.shift_labels(ids)
    logits_of = randn(70, 2, 8, 32)  # stands in for a model's logits, sharded with the ids

    def labels_left_out():
        logits, kept_ids = logits_of.clone(), ids.clone()
        with rt.maybe_context_parallel(buffers=[kept_ids, logits], buffer_seq_dims=[1, 1]):
            F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    def token_mean_of_full_labels():
        kept_ids = ids.clone()
        with rt.maybe_context_parallel(buffers=[kept_ids], buffer_seq_dims=[1]):
            rt.token_mean(torch.ones(()), labels)

    def different_data():
        mine = ids.clone() + rt.cp_rank  # as if each rank drew its own batch
        with rt.maybe_context_parallel(buffers=[mine], buffer_seq_dims=[1]):
            pass

    def different_lengths():
        mine = torch.arange(8 * (1 + rt.cp_rank)).view(1, -1)
        with rt.maybe_context_parallel(buffers=[mine], buffer_seq_dims=[1]):
            pass

    def labels_along_the_batch():
        batch = torch.arange(64).view(4, 16)  # 4 rows: dim 0 splits over cp 2 as evenly as the tokens would
        kept_ids, kept_labels = batch.clone(), cpctl.shift_labels(batch)
        with rt.maybe_context_parallel(buffers=[kept_ids, kept_labels], buffer_seq_dims=[1, 0]):
            rt.token_mean(torch.ones(()), kept_labels)

    results["labels_left_out"] = error_of(labels_left_out)
    results["labels_along_the_batch"] = error_of(labels_along_the_batch)
    results["token_mean_full_labels"] = error_of(token_mean_of_full_labels)
    results["different_data"] = error_of(different_data)
    results["different_lengths"] = error_of(different_lengths)
    results["optimizer_before_prepare"] = optimizer_before_prepare(rt)
    results["prepared_twice"] = prepared_twice(rt)
    return results


def prepared_twice(rt: Runtime) -> dict:
    """rt.prepare_model on the model it returned: refused, naming the fix (FSDP2's own refusal names neither)."""
    prepared = rt.prepare_model(TinyLM())
    return error_of(lambda: rt.prepare_model(prepared))


def optimizer_before_prepare(rt: Runtime) -> dict:
    """An optimizer built on the parameters prepare_model replaces would train nothing: refused."""
    model = TinyLM()
    stale = torch.optim.SGD(model.parameters(), lr=1e-3)
    model = rt.prepare_model(model)
    fresh = torch.optim.SGD(model.parameters(), lr=1e-3)
    fresh.step()  # the right order still works
    return error_of(stale.step)


def quantized(kind: str) -> torch.nn.Module:
    """TinyLM with quantized weights, as a QLoRA base would hold them (torch's own kinds: no
    bitsandbytes here): a weight stored in float8, or torch's dynamically quantized int8 Linear."""
    model = TinyLM()
    if kind == "float8":
        layer = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        layer.weight = torch.nn.Parameter(layer.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
        return model
    return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def case_misuse_single(rt: Runtime) -> dict:
    return {"optimizer_before_prepare": optimizer_before_prepare(rt), "prepared_twice": prepared_twice(rt),
            "quantized_float8": error_of(lambda: rt.prepare_model(quantized("float8"))),
            "quantized_int8": error_of(lambda: rt.prepare_model(quantized("int8")))}


CP_CASES = [case_attributes, case_bad_inputs, case_causal_mask_accepted, case_buffers, case_shard_unshard,
            case_step_state, case_functional_attention, case_model_in_context, case_token_mean, case_fsdp_gradients,
            case_two_groups, case_dataloader, case_multihead_attention, case_misuse]
SINGLE_CASES = [case_attributes, case_single_process, case_shard_unshard, case_token_mean, case_misuse_single]


def main() -> None:
    output = sys.argv[1]
    rt = cpctl.init()
    results = {}
    for case in CP_CASES if rt.world_size > 1 else SINGLE_CASES:
        name = case.__name__.removeprefix("case_")
        try:
            results[name] = case(rt)
        except Exception:  # noqa: BLE001 - recorded; the test shows it
            results[name] = {"crashed": traceback.format_exc()}
    gathered = [None] * rt.world_size
    dist.all_gather_object(gathered, results)
    if rt.is_main:
        with open(output, "w") as f:
            json.dump({"world": rt.world_size, "ranks": gathered}, f)


if __name__ == "__main__":
    main()
