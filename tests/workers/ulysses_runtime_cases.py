"""Worker: Hugging Face models, unmodified, under Ulysses (sp) and 2D (sp x cp) against one process.

    cpctl launch --device cpu --nproc-per-node 4 --sp-size 4 tests/workers/ulysses_runtime_cases.py OUT.json

Each case takes one training step of a tiny random model on a global batch of 2 rows per dp rank
(every rank builds the same global batch; dp rank r takes its rows), and compares the loss, the
logits (gathered with rt.unshard, as an evaluation would) and every parameter gradient with the
same step in one plain process on the whole batch. Rank 0 writes {case: errors or the error
message} to OUT.json; the assertions live in tests/test_ulysses_runtime.py.
"""

import copy
import json
import sys
import traceback

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

import cpctl

SEQ = 64
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, attn_implementation="sdpa")


def llama(kv_heads: int):
    return LlamaForCausalLM(LlamaConfig(**COMMON, num_key_value_heads=kv_heads))


def mistral():  # every layer a sliding window of 24 tokens: it cuts through every shard
    config = MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=24)
    return MistralForCausalLM(config)


def packed_positions(rows: int) -> torch.Tensor:
    lengths = [[5, 1, 20, 30, 8], [17, 31, 16]]
    return torch.cat([cpctl.position_ids_for_documents([lengths[r % 2]]) for r in range(rows)])


def grad_error(model, reference) -> float:
    grads = dict(reference.named_parameters())
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
    return max((p.grad.full_tensor() - grads[name.replace("._checkpoint_wrapped_module", "")].grad).abs().max().item()
               for name, p in model.named_parameters())


def step(rt, make_model, *, loss: str, packed: bool = False) -> dict:
    """One step with cpctl and the same step in one process; the max abs errors."""
    torch.manual_seed(0)
    reference = make_model()
    model = rt.prepare_model(copy.deepcopy(reference))
    rows = 2 * rt.dp_size
    ids_all = torch.randint(COMMON["vocab_size"], (rows, SEQ), generator=torch.Generator().manual_seed(1))
    pos_all = packed_positions(rows) if packed else cpctl.position_ids_like(ids_all)
    mine = slice(2 * rt.dp_rank, 2 * rt.dp_rank + 2)

    ref_out = reference(input_ids=ids_all, position_ids=pos_all if packed else None, labels=ids_all, use_cache=False)
    ref_out.loss.backward()

    ids, pos = ids_all[mine].clone(), pos_all[mine].clone()
    labels = ids.clone()
    with rt.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                   no_restore_buffers={ids, labels, pos}, documents=pos if packed else None):
        kwargs = {"position_ids": pos} if packed else {}  # without: the model's own positions, filled by cpctl
        if loss == "model":
            value = model(input_ids=ids, labels=labels, **kwargs).loss
        else:
            value = rt.causal_lm_loss(model, input_ids=ids, labels=labels, **kwargs)
        value.backward()
    grads = grad_error(model, reference)
    ids, pos = ids_all[mine].clone(), pos_all[mine].clone()
    # evaluation: the logits of the whole sequence, gathered
    with rt.maybe_context_parallel(buffers=[ids, pos], buffer_seq_dims=[1, 1], no_restore_buffers={ids, pos},
                                   documents=pos if packed else None), torch.no_grad():
        logits = rt.unshard(model(input_ids=ids, **kwargs).logits, seq_dim=1)
    with torch.no_grad():
        ref_logits = reference(input_ids=ids_all[mine], position_ids=pos_all[mine] if packed else None,
                               use_cache=False).logits  # with a cache, transformers does not look for packing
    return {"loss": abs(value.item() - ref_out.loss.item()), "logits": (logits - ref_logits).abs().max().item(),
            "grads": grads}


def refusal(action) -> str | None:
    try:
        action()
    except cpctl.CpctlError as exc:
        return str(exc)
    return None


def short_sequence(rt):
    # maybe_context_parallel pads such a length at the end; the functional shard refuses it
    rt.shard(torch.zeros(1, SEQ - 1, dtype=torch.long), seq_dim=1)


def main() -> None:
    rt = cpctl.init()
    cases = {
        "llama_loss": lambda: step(rt, lambda: llama(2), loss="model"),
        "llama_mqa": lambda: step(rt, lambda: llama(1), loss="model"),  # one K/V head, replicated over sp
        "llama_chunked_loss": lambda: step(rt, lambda: llama(2), loss="chunked"),
        "llama_packed": lambda: step(rt, lambda: llama(2), loss="model", packed=True),
        "mistral_window": lambda: step(rt, mistral, loss="model"),
        "mistral_window_packed": lambda: step(rt, mistral, loss="chunked", packed=True),
    }
    results = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception:  # noqa: BLE001 - recorded for the test to show
            results[name] = {"crashed": traceback.format_exc()}
    five_heads = dict(COMMON, hidden_size=40, num_attention_heads=5)
    results["refused_heads"] = refusal(
        lambda: rt.prepare_model(LlamaForCausalLM(LlamaConfig(**five_heads, num_key_value_heads=5))))
    results["refused_length"] = refusal(lambda: short_sequence(rt))
    results["sizes"] = {"cp": rt.cp_size, "sp": rt.sp_size, "dp": rt.dp_size, "seq": rt.seq_size,
                        "mesh": list(rt.mesh.mesh_dim_names)}
    if rt.is_main:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
