"""Worker: packed documents under CP against one process and against the documents one by one.

Two models: the example Llama (scripts/llama.py, plain SDPA calls) and an unmodified Hugging Face
Llama. Every case packs documents of given lengths into one row (batch 2, rows packed
differently) and takes one training step; rank 0 writes, per case, the loss and the max abs
difference of the loss and of every gradient against each reference, to argv[1] as JSON.

References: the documents one by one (each its own forward, losses summed over all tokens),
and, for the Hugging Face model, one process on the packed rows with the same position ids
(transformers then builds its document mask itself).
"""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import cpctl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import llama as example  # noqa: E402

SEQ = 64
PACKINGS = {  # lengths per row; every row adds up to SEQ
    "mixed": [[5, 1, 20, 30, 8], [40, 24]],
    "one_token_docs": [[1, 1, 1, 13, 1, 47], [1] * 8 + [56]],
    "whole_sequence": [[SEQ], [33, 31]],
    "many_short": [[4] * 16, [2] * 32],
    "spanning_ranks": [[15, 2, 30, 17], [17, 31, 16]],
}
# At cp 1 only: a row of odd length (59 tokens), which no CP size > 1 can divide; one process needs no padding.
ODD_PACKING = {"odd_length": [[5, 1, 20, 33], [40, 19]]}


def logits_of(model, ids, pos, *, hf: bool):
    return model(input_ids=ids, position_ids=pos, use_cache=False).logits if hf else model(ids, position_ids=pos)


def one_by_one(model, ids, lengths, *, hf: bool, per_document: bool = False):
    """Loss sum and token count of every document of every row, each run alone
    (per_document: the sum of the documents' own mean losses, and how many documents)."""
    total, tokens = 0.0, 0
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            doc = ids[row:row + 1, start:start + length]
            start += length
            labels = cpctl.shift_labels(doc)
            if length == 1:
                continue  # its only token predicts nothing
            logits = logits_of(model, doc, cpctl.position_ids_like(doc), hf=hf)
            doc_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
            doc_tokens = int((labels != -100).sum())
            total = total + (doc_sum / doc_tokens if per_document else doc_sum)
            tokens += 1 if per_document else doc_tokens
    return total, tokens


def grads_of(model) -> dict:
    return {name.replace("._checkpoint_wrapped_module", ""): (p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                                                               else p.grad).detach().clone()
            for name, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in b)


def build(kind: str):
    torch.manual_seed(0)
    if kind == "hf":
        config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             initializer_range=0.1, attn_implementation="sdpa")
        return LlamaForCausalLM(config)
    return example.Llama(example.LlamaConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                             ffn_dim=64))


def run(rt, kind: str, packing: str, *, documents_arg: bool, leak: bool = False, per_document: bool = False) -> dict:
    hf = kind == "hf"
    reference = build(kind)
    lengths = {**PACKINGS, **ODD_PACKING}[packing]
    ids_full = torch.randint(128, (2, sum(lengths[0])), generator=torch.Generator().manual_seed(7))
    pos_full = cpctl.position_ids_for_documents(lengths)
    labels_full = cpctl.shift_labels(ids_full, position_ids=pos_full)

    # Reference 1: the documents one by one.
    alone = copy.deepcopy(reference)
    loss_sum, tokens = one_by_one(alone, ids_full, lengths, hf=hf, per_document=per_document)
    (loss_sum / tokens).backward()
    result = {"tokens": tokens, "loss_alone": (loss_sum / tokens).item()}
    # Reference 2 (Hugging Face): one process on the packed rows; transformers sees the restarts.
    if hf:
        packed = copy.deepcopy(reference)
        logits = logits_of(packed, ids_full, pos_full, hf=True)
        F.cross_entropy(logits.float().flatten(0, 1), labels_full.flatten(), ignore_index=-100).backward()

    model = rt.prepare_model(copy.deepcopy(reference))
    ids, labels, pos = ids_full.clone(), labels_full.clone(), pos_full.clone()
    context = dict(documents=pos_full) if documents_arg and not leak else {}
    with rt.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                   no_restore_buffers={ids, labels, pos}, **context):
        if leak:  # attention blind to the documents: must differ from the references
            pos.copy_(rt.shard(cpctl.position_ids_like(ids_full), seq_dim=1))
        logits = logits_of(model, ids, pos, hf=hf)
        if per_document:  # each document's own mean, then the mean over documents
            token_losses = F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")
            loss = rt.document_mean(token_losses, labels, pos)
        else:
            loss = rt.token_mean(F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum"),
                                 labels)
        loss.backward()
    cp_grads = grads_of(model)
    result.update(loss=loss.item(), loss_vs_alone=abs(loss.item() - result["loss_alone"]),
                  grads_vs_alone=max_diff(cp_grads, grads_of(alone)), balance=rt.cp_balance,
                  local_chunks=len(rt.layout.local_chunks))
    if hf:
        result["grads_vs_packed"] = max_diff(cp_grads, grads_of(packed))
    return result


def main() -> None:
    rt = cpctl.init()
    results = {}
    for kind in ("example", "hf"):
        for packing in [*PACKINGS, *(ODD_PACKING if rt.cp_size == 1 else ())]:
            for documents_arg in ((True, False) if kind == "hf" else (True,)):
                name = f"{kind}/{packing}/{'documents' if documents_arg else 'positions'}"
                results[name] = run(rt, kind, packing, documents_arg=documents_arg)
    results["example/mixed/leak"] = run(rt, "example", "mixed", documents_arg=False, leak=True)
    for packing in ("mixed", "one_token_docs"):
        results[f"example/{packing}/document_mean"] = run(rt, "example", packing, documents_arg=True, per_document=True)
    if rt.is_main:
        with open(sys.argv[1], "w") as f:
            json.dump({"cp": rt.cp_size, "strategy": rt.config.parallelism.cp_comm_strategy, "cases": results}, f)


if __name__ == "__main__":
    main()
