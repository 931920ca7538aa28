"""Worker: a Hugging Face Llama (attn_implementation="sdpa"), unmodified, under cpctl's CP
(with argv[2] "checkpointing": a sliding-window Mistral, checkpointed, backward after the context).

Logits and parameter gradients of a CP step must equal a plain single-process step of the
same model on the full sequence. Rank 0 writes the max abs differences to argv[1] as JSON.
"""

import copy
import json
import sys

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import cpctl
import cpctl.runtime.context
from cpctl.runtime.tiling import tiled_layers


def main() -> None:
    # "checkpointing": the model's own gradient_checkpointing_enable() before prepare_model, and
    # backward after the context exits, so the blocks' recompute must route attention by itself.
    checkpointing = sys.argv[2:] == ["checkpointing"]
    rt = cpctl.init()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa")
    if checkpointing:  # a sliding window (24 tokens, shards of 16): the recompute must keep it
        config = MistralConfig(**{**config.to_dict(), "sliding_window": 24, "model_type": "mistral"})
    reference = (MistralForCausalLM if checkpointing else LlamaForCausalLM)(config)
    model = copy.deepcopy(reference)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model = rt.prepare_model(model)
    ids = torch.randint(config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))

    # The plain step: the whole sequence in one process.
    labels = cpctl.shift_labels(ids)
    ref_logits = reference(input_ids=ids).logits
    F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()

    # The CP step, as README.md's training loop writes it; the engine's calls are counted.
    attention_calls = count_calls(cpctl.runtime.context, "context_parallel_attention")
    pos = cpctl.position_ids_like(ids)
    with rt.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                   no_restore_buffers={ids, labels, pos}):
        logits = model(input_ids=ids, position_ids=pos).logits
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        loss = rt.token_mean(loss_sum, labels)
        if not checkpointing:
            loss.backward()
        full_logits = rt.unshard(logits.detach(), 1)
    if checkpointing:
        loss.backward()

    grads = dict(reference.named_parameters())
    grad_error = max(
        (param.grad.full_tensor() - grads[name.replace("._checkpoint_wrapped_module", "")].grad).abs().max().item()
        for name, param in model.named_parameters()
    )
    calls_in_step = attention_calls[0]
    refusals = refused_calls(rt, model, config)  # after the step: they raise mid-forward
    if rt.is_main:
        with open(sys.argv[1], "w") as f:
            checkpointed = any("checkpoint" in type(m).__name__.lower() for m in model.modules())
            tiled = [layer.key for layer in tiled_layers(model)]
            json.dump({"attention_calls": calls_in_step, "checkpointed": checkpointed, "tiled_mlps": tiled.count("memory.tiled_mlp_tokens"), "tiled_norms": tiled.count("memory.tiled_norm_tokens"), "cp": rt.cp_size, "tp": rt.config.parallelism.tp_size,
                       "logits": (full_logits - ref_logits.detach()).abs().max().item(),
                       "grads": grad_error, "n_params": len(grads), "refusals": refusals}, f)


def count_calls(module, name: str) -> list[int]:
    """A one-element list counting the calls of `module.name` from now on."""
    calls, inner = [0], getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    setattr(module, name, counted)
    return calls


def refused_calls(rt, model, config) -> dict:
    """Calls CP cannot make exact, each answered with one clear error: {case: message or None}."""
    def error_of(action):
        try:
            action()
        except cpctl.CpctlError as exc:
            return str(exc)
        return None

    def step(**call):
        ids = torch.randint(config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
        buffers = [ids] + [t for t in call.values() if isinstance(t, torch.Tensor) and t.shape == ids.shape and t.dim() == 2
                           and call.get("_unsharded") is not t]
        call.pop("_unsharded", None)
        with rt.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers)):
            model(input_ids=ids, **call)

    ready_made_mask = torch.ones(2, 1, 64, 64, dtype=torch.bool).tril()  # a 4-D mask: not a padding mask
    full_labels = torch.zeros(2, 64, dtype=torch.long)
    def unprepared_model():  # not given to prepare_model: on a shard its positions would be the shard's
        plain = LlamaForCausalLM(config)
        ids = torch.randint(config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
        with rt.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1]):
            plain(input_ids=ids)

    def checkpointing_enabled_late():
        model.gradient_checkpointing_enable()
        try:
            step()
        finally:
            model.gradient_checkpointing_disable()

    def falcon(**config_overrides):
        from transformers import FalconConfig, FalconForCausalLM

        return FalconForCausalLM(FalconConfig(vocab_size=config.vocab_size, hidden_size=32, num_attention_heads=4,
                                              num_hidden_layers=2, attention_dropout=0.0, hidden_dropout=0.0,
                                              attn_implementation="sdpa", **config_overrides))

    def falcon_step(model, **call):
        ids = torch.randint(config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
        with rt.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1]):
            model(input_ids=ids, **call)

    def falcon_alibi():  # refused by prepare_model under CP; at cp 1 inside the context
        falcon_step(rt.prepare_model(falcon(alibi=True)))

    def falcon_output_attentions():  # Falcon then attends without SDPA
        falcon_step(rt.prepare_model(falcon()), output_attentions=True)

    def attention_dropout():
        # refused by prepare_model under CP; at cp 1 the model stays transformers' own outside the
        # context, and is refused inside it
        dropping = rt.prepare_model(LlamaForCausalLM(config.__class__(**{**config.to_dict(), "attention_dropout": 0.1})))
        ids = torch.randint(config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
        dropping(input_ids=ids)
        with rt.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1]):
            dropping(input_ids=ids)

    return {
        "checkpointing_after_prepare": error_of(checkpointing_enabled_late),
        "mask_4d": error_of(lambda: step(attention_mask=ready_made_mask)),
        "unprepared_model": error_of(unprepared_model),
        "use_cache": error_of(lambda: step(use_cache=True)),
        # a caller's own count (outside the Trainer's compute_loss): made before sharding, it would count
        # each token once per CP rank
        "num_items_in_batch": error_of(lambda: step(labels=torch.zeros(2, 64, dtype=torch.long), num_items_in_batch=126)),
        "labels_not_in_buffers": error_of(lambda: step(labels=full_labels, _unsharded=full_labels)),
        "attention_dropout": error_of(attention_dropout),
        # Falcon has no TP plan: under tp > 1 prepare_model refuses it for that
        **({"falcon_alibi": error_of(falcon_alibi), "falcon_output_attentions": error_of(falcon_output_attentions)}
           if rt.config.parallelism.tp_size == 1 else {}),
    }


if __name__ == "__main__":
    main()
