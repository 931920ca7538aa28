"""Worker for tests/test_row_ends.py: rows whose end the CP layout does not divide, and padded batches.

    cpctl launch --device cpu --nproc-per-node 2 --cp-size 2 tests/workers/row_end_cases.py OUT.json
    (also at cp 1 and sp 2 x cp 2: every case holds at every size)

Each case runs a step of a tiny Hugging Face Llama (or a plain SDPA call) under CP and the same
step in this process on the full batch, the simple way; it records the largest differences, or
the message of the error it was answered with. Every rank runs every case (they hold
collectives); rank 0 writes {case: result} to OUT.json. The assertions live in the test.
"""

from __future__ import annotations

import copy
import json
import sys
import traceback

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import cpctl

VOCAB = 128


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(config)


def tokens(rows: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def grad_gap(model, reference) -> float:
    grads = dict(reference.named_parameters())
    return max((p.grad.full_tensor() - grads[name].grad).abs().max().item() for name, p in model.named_parameters())


def pair(rt):
    """A model prepared for CP and its plain twin, with the same weights."""
    reference = llama()
    return rt.prepare_model(copy.deepcopy(reference)), reference


def case_readme_loop_odd_length(rt) -> dict:
    """README's loop (shift_labels, position_ids_like, token_mean) on 63 tokens: padded to 64."""
    model, reference = pair(rt)
    ids = tokens(2, 63)
    labels = cpctl.shift_labels(ids)
    ref_logits = reference(input_ids=ids).logits
    F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    pos = cpctl.position_ids_like(ids)
    kept = ids.clone()
    with rt.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1], no_restore_buffers={labels, pos}):
        logits = model(input_ids=ids, position_ids=pos).logits
        loss = rt.token_mean(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"), labels)
        loss.backward()
        local_len = ids.shape[1]
        full = rt.unshard(logits.detach(), 1)
    return {"local_len": local_len, "unsharded_shape": list(full.shape), "logits": (full - ref_logits).abs().max().item(),
            "grads": grad_gap(model, reference), "restored": list(ids.shape), "restored_same": torch.equal(ids, kept)}


def case_model_loss_odd_length(rt) -> dict:
    """accelerate's guide form: the model's own loss, labels = ids (unshifted), no positions; 61 tokens."""
    model, reference = pair(rt)
    ids = tokens(2, 61, seed=2)
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    labels = ids.clone()
    with rt.maybe_context_parallel(buffers=[ids, labels], buffer_seq_dims=[1, 1], no_restore_buffers={ids, labels}):
        got = model(input_ids=ids, labels=labels).loss
        got.backward()
    return {"loss": abs(got.item() - want.item()), "grads": grad_gap(model, reference)}


def padded(rows_lengths: list[int], length: int, *, side: str = "right", seed: int = 3) -> dict[str, torch.Tensor]:
    """What DataCollatorForLanguageModeling builds (tokenizer.padding_side = `side`): ids padded with 0,
    the mask, labels -100 at the pads."""
    ids = tokens(len(rows_lengths), length, seed=seed)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(rows_lengths):
        mask[row, :n] = 1
    if side == "left":
        mask = mask.flip(1)
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def padded_step(rt, batch: dict[str, torch.Tensor], *, pad_values=None) -> dict:
    """The model's own loss on `batch` (with its attention_mask) under CP against one process;
    logits compared at every position, padding included."""
    model, reference = pair(rt)
    want = reference(**batch)
    want.loss.backward()
    inputs = {name: t.clone() for name, t in batch.items()}
    buffers = list(inputs.values())
    with rt.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers),
                                   pad_values=pad_values):
        out = model(**inputs)
        out.loss.backward()
        logits = rt.unshard(out.logits.detach(), 1)
    return {"loss": abs(out.loss.item() - want.loss.item()), "grads": grad_gap(model, reference),
            "logits": (logits - want.logits.detach()).abs().max().item()}


def case_right_padding(rt) -> dict:
    """A right-padded batch (rows of 59 and 40 tokens, 59 long: padded to 60 as well)."""
    return padded_step(rt, padded([59, 40], 59), pad_values=[None, 0, -100])


def case_left_padding(rt) -> dict:
    """A left-padded batch (59 and 40 tokens, 59 long): the second row's padding fills whole shards,
    whose queries see no key; the last pad's prediction of the first token counts, as in one process."""
    return padded_step(rt, padded([59, 40], 59, side="left"), pad_values=[None, 0, -100])


def case_holes(rt) -> dict:
    """Zeros inside the mask, and labels that count every position (padding tokens' too)."""
    batch = padded([64, 64], 64, seed=7)
    batch["attention_mask"][0, 5:9] = 0
    batch["attention_mask"][1, 20:45] = 0
    batch["attention_mask"][1, :2] = 0
    batch["labels"] = batch["input_ids"].clone()
    return padded_step(rt, batch)


def case_left_padding_with_positions(rt) -> dict:
    """Left padding with the position ids generation builds from the mask (cumsum - 1, pads at 1):
    with a mask, transformers reads them as positions only, never as packed documents."""
    batch = padded([64, 37], 64, side="left", seed=8)
    positions = (batch["attention_mask"].cumsum(1) - 1).masked_fill(batch["attention_mask"] == 0, 1)
    return padded_step(rt, {**batch, "position_ids": positions})


def case_bidirectional_padded(rt) -> dict:
    """Attention that is not causal on 31 tokens (padded to 32): the appended token is seen by no query."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 31, 8, generator=gen) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v)
    qs, ks, vs = q.clone(), k.clone(), v.clone()
    with rt.maybe_context_parallel(buffers=[qs, ks, vs], buffer_seq_dims=[2, 2, 2], no_restore_buffers={qs, ks, vs}):
        out = rt.unshard(F.scaled_dot_product_attention(qs, ks, vs), 2)
    return {"out": (out - want).abs().max().item()}


def case_packed_odd_length(rt) -> dict:
    """Packed documents (positions restarting, documents=) in 45 tokens: padded to 48."""
    model, reference = pair(rt)
    pos = cpctl.position_ids_for_documents([[20, 1, 24]])
    ids = tokens(1, 45, seed=4)
    labels = cpctl.shift_labels(ids, position_ids=pos)
    ref = reference(input_ids=ids, position_ids=pos).logits
    F.cross_entropy(ref.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    with rt.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                   no_restore_buffers={ids, labels, pos}, documents=pos.clone()):
        logits = model(input_ids=ids, position_ids=pos).logits
        rt.token_mean(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"), labels).backward()
        full = rt.unshard(logits.detach(), 1)
    return {"logits": (full - ref).abs().max().item(), "grads": grad_gap(model, reference)}


def case_pad_values_for_plain_labels(rt) -> dict:
    """nanoGPT's x, y = data[:, :-1], data[:, 1:]: y ends with a real token. cpctl's rule would
    repeat it (token_mean refuses); pad_values=[None, -100] makes it exact."""
    model, reference = pair(rt)
    data = tokens(2, 64, seed=5)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    F.cross_entropy(reference(input_ids=x).logits.flatten(0, 1), y.flatten()).backward()

    def step(**options):
        xs, ys = x.clone(), y.clone()
        with rt.maybe_context_parallel(buffers=[xs, ys], buffer_seq_dims=[1, 1], no_restore_buffers={xs, ys}, **options):
            logits = model(input_ids=xs).logits
            loss = rt.token_mean(F.cross_entropy(logits.flatten(0, 1), ys.flatten(), reduction="sum"), ys)
            loss.backward()

    refused = error_of(step)
    for param in model.parameters():
        param.grad = None
    step(pad_values=[None, -100])
    return {"refused": refused, "grads": grad_gap(model, reference)}


def case_refusals(rt) -> dict:
    model, _ = pair(rt)

    def call(batch, **options):
        inputs = {name: t.clone() for name, t in batch.items()}
        buffers = list(inputs.values())
        with rt.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers), **options):
            model(**inputs)

    return {"pad_values_length": error_of(lambda: call({"input_ids": tokens(1, 63)}, pad_values=[0, 0])),
            "shard_uneven": error_of(lambda: rt.shard(tokens(1, 7), seq_dim=1))}


def error_of(action) -> str | None:
    try:
        action()
    except cpctl.CpctlError as exc:
        return str(exc)
    return None


def main() -> None:
    rt = cpctl.init()
    results = {}
    for name, case in [(n, f) for n, f in globals().items() if n.startswith("case_")]:
        try:
            results[name.removeprefix("case_")] = case(rt)
        except Exception:  # noqa: BLE001 - recorded for the test, the next case still runs
            results[name.removeprefix("case_")] = {"crashed": traceback.format_exc()}
    if rt.is_main:
        with open(sys.argv[1], "w") as f:
            json.dump({"cp": rt.cp_size, "sp": rt.sp_size, "cases": results}, f)


if __name__ == "__main__":
    main()
