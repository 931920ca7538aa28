"""Hugging Face transformers models under CP, unmodified: attention, masks, positions and `.loss`.

A prepared model (at every cp size, 1 included) gets the attention implementation "cpctl",
registered with transformers' own `AttentionInterface` and `AttentionMaskInterface` (the hooks
libraries that bring their own attention use):

* masks: inside `maybe_context_parallel` no mask is built from a shard (a shard is not a
  sequence: its head-tail chunks look like packed documents, its length hides windows);
  outside, masks are what "sdpa" builds;
* attention: inside, the layer's own pattern (causal or not, its sliding window, its
  attention chunk) is read from the module and the config and computed by the CP engine;
  outside, it is "sdpa" unchanged;
* the model's forward: position ids the caller left out are filled in with the true ones,
  and `labels` get the single-process loss: shifted over the whole sequence and averaged
  over every token of the dp x cp batch.

A model that does not take attention implementations but calls SDPA itself with the mask
transformers builds (Falcon) keeps "sdpa": inside `maybe_context_parallel` it is handed a mask
that its SDPA calls read as its causal mask over the whole sequence (`MODEL_CAUSAL_MASK`), and
those calls are routed like any other code's.

A 2-D attention_mask (left or right padding, holes) becomes keys no query sees
(hf_padding.py): every position as transformers computes it.

Packed documents are read from position ids exactly when transformers reads them in one
process: no attention_mask and no KV cache (use_cache off: the config's default, True, keeps
transformers from reading them).

What cannot be expressed is refused before the first step, from the config, or at the call,
with the setting to change: never a silently different model. At cp_size 1 a model whose
config cannot be computed is left to transformers outside `maybe_context_parallel` (it is then
transformers' own model) and refused inside it, as under CP.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from cpctl.attention.dispatch import MODEL_CAUSAL_MASK
from cpctl.errors import CpctlError
from cpctl.integrations import fsdp_saving

if TYPE_CHECKING:
    from cpctl.integrations.runtime_view import RuntimeView

IMPLEMENTATION = "cpctl"
# Layer kinds (config.layer_types) that call the attention function; anything else mixes
# tokens some other way (linear attention, state spaces, convolutions) that CP cannot shard.
ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")
IGNORE_INDEX = -100
_log = logging.getLogger("cpctl")


def huggingface_model_in(model: nn.Module) -> nn.Module | None:
    """The transformers model that `model` is or wraps (a PEFT model's base model), else None:
    cpctl's attention, masks and checks go on that one, which the wrapper's forward calls."""
    if "transformers" not in sys.modules:  # never import it for a model that is not one
        return None
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return model
    get_base_model = getattr(model, "get_base_model", None)  # peft.PeftModel (and its task subclasses)
    inner = get_base_model() if callable(get_base_model) and "peft" in sys.modules else None
    return inner if isinstance(inner, PreTrainedModel) else None


# ---------------------------------------------------------------------------- before the first step


def prepare(model: nn.Module, runtime: RuntimeView) -> bool:
    """Check `model`'s config for what CP cannot compute, then route its attention through cpctl.

    Returns whether the model had its own gradient checkpointing on: it is turned off here
    (its recompute would run outside CP's routing) and the runtime checkpoints the blocks instead.
    """
    global _runtime
    _runtime = runtime
    fsdp_saving.install()  # once sharded, save_pretrained must gather before it writes
    config = model.config
    problems = [*_config_problems(config),
                *_head_problems(config, sp_size=runtime.sp_size, tp_size=runtime.config.parallelism.tp_size)]
    problem = next(iter(problems), None)
    calls_sdpa = False
    if problem is None:
        _register()
        if _takes_attention_interface(model):
            model.set_attn_implementation(IMPLEMENTATION)
        if model.config._attn_implementation != IMPLEMENTATION:
            problem = _sdpa_call_problem(model)
            calls_sdpa = problem is None
    if problem is not None:
        problem = f"{type(model).__name__} cannot run under context parallelism: {problem}"
        if runtime.seq_size > 1:
            raise CpctlError(problem)
        # cp_size 1: outside the context the model is transformers' own; inside, refused as under CP.
        _log.info("%s keeps transformers' attention (refused inside maybe_context_parallel): %s",
                  type(model).__name__, problem)
        model.register_forward_pre_hook(lambda module, args: _refuse_inside(runtime, problem))
        return False
    model._cpctl_calls_sdpa = calls_sdpa
    model.register_forward_pre_hook(lambda module, args, kwargs: _before_forward(module, args, kwargs, runtime),
                                    with_kwargs=True)
    model.register_forward_hook(lambda module, args, output: _after_forward(module, output, runtime))
    checkpointing = _checkpointing_on(model)
    if checkpointing:
        model.gradient_checkpointing_disable()
    # transformers runs a model under its own gradient checkpointing without a KV cache
    model._cpctl_cache_off_in_training = checkpointing
    return checkpointing


def _refuse_inside(runtime: RuntimeView, problem: str) -> None:
    if runtime.cp_active:
        raise CpctlError(problem)


def _takes_attention_interface(model: nn.Module) -> bool:
    """transformers' own test (5.x): whether set_attn_implementation can switch this model."""
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    return bool(can_set()) if callable(can_set) else True


def _sdpa_call_problem(model: nn.Module) -> str | None:
    """None when a model that takes no attention implementation calls SDPA itself on a plain causal
    mask, which cpctl then routes; else why cpctl cannot see its attention."""
    config = model.config
    if config._attn_implementation != "sdpa":
        return (f"its attention is {config._attn_implementation!r} and it does not take transformers' "
                "AttentionInterface; build it with attn_implementation=\"sdpa\"")
    try:
        source = inspect.getsource(sys.modules[type(model).__module__])
    except (KeyError, OSError, TypeError):
        source = ""
    if "scaled_dot_product_attention(" not in source:
        return ("it neither takes transformers' AttentionInterface nor calls scaled_dot_product_attention, "
                "so cpctl cannot see its attention; run it outside maybe_context_parallel, at cp_size 1")
    if getattr(config, "alibi", False):
        return "alibi=True adds position biases to the attention scores, which fused kernels cannot; use rotary (alibi=False)"
    if getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None) or any(
            kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return ("its windowed or chunked layers live in masks it hands SDPA itself, which cpctl cannot read; "
                "only its plain causal attention can be routed")
    return None


def _checkpointing_on(model: nn.Module) -> bool:
    # transformers renamed the property (is_gradient_checkpointing warns from 5.2x on)
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def _config_problems(config) -> Iterator[str]:
    configs = [config, *(getattr(config, name) for name in getattr(config, "sub_configs", {}) if getattr(config, name, None) is not None)]
    for cfg in configs:
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            yield (f"attn_logit_softcapping={cfg.attn_logit_softcapping} caps scores inside attention, which fused "
                   "kernels cannot do; set it to None")
        for name in ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop"):
            if getattr(cfg, name, 0) not in (0, 0.0, None):
                yield f"{name}={getattr(cfg, name)}: attention dropout is not supported under CP; set it to 0.0"
        for kind in set(getattr(cfg, "layer_types", None) or ()):
            if kind not in ATTENTION_LAYERS:
                yield (f"its layer_types include {kind!r}, which mixes tokens outside attention and cannot be "
                       f"sharded by sequence; cpctl shards {', '.join(ATTENTION_LAYERS)} layers")


def _head_problems(config, *, sp_size: int, tp_size: int) -> Iterator[str]:
    """Ulysses splits each rank's attention heads over sp ranks: they must divide evenly. (K/V heads
    need not: fewer than sp are replicated, exactly.)"""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if sp_size > 1 and isinstance(heads, int) and (heads // tp_size) % sp_size:
        per_rank = f"{heads // tp_size} per tp rank" if tp_size > 1 else f"{heads}"
        yield (f"sp_size {sp_size} splits attention heads, but it has {per_rank} attention heads; choose an sp_size "
               f"that divides {heads // tp_size}")


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, attention)
    AttentionMaskInterface.register(IMPLEMENTATION, mask)
    _registered = True


# ---------------------------------------------------------------------------- masks and attention


# The runtime, handed down by prepare(): this module sits below the runtime and never imports it.
_runtime: RuntimeView | None = None


def _active() -> RuntimeView | None:
    """The runtime while its maybe_context_parallel routes attention, else None."""
    return _runtime if _runtime is not None and _runtime.cp_active else None


def mask(*args: Any, attention_mask: torch.Tensor | None = None, use_vmap: bool = False, **kwargs: Any):
    """transformers' mask hook: under CP build nothing (the engine knows each layer's pattern)."""
    from transformers.masking_utils import sdpa_mask

    runtime = _active()
    if runtime is None:
        return sdpa_mask(*args, attention_mask=attention_mask, use_vmap=use_vmap, **kwargs)
    if attention_mask is not None:  # a model whose forward cpctl did not see first: its padding, as hidden keys
        from cpctl.integrations import hf_padding

        runtime.hide_keys(hf_padding.hidden_keys(runtime, attention_mask))
    if use_vmap:  # transformers builds custom overlays (image tokens, bidirectional blocks) this way
        raise CpctlError(
            "the model asks for a custom attention mask (e.g. bidirectional image tokens) under context parallelism; "
            "cpctl computes causal, sliding-window and chunked attention only"
        )
    return None


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention hook: the layer's own pattern, computed across the CP group."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    runtime = _active()
    if runtime is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is not None:
        raise CpctlError(
            f"{type(module).__name__} was handed a ready-made attention mask under context parallelism; cpctl "
            "computes the masks transformers builds for causal, sliding-window and chunked layers only"
        )
    if dropout:
        raise CpctlError(f"attention dropout {dropout} under context parallelism; set the model's attention dropout to 0.0")
    for name in ("softcap", "position_bias", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise CpctlError(f"{type(module).__name__} passes {name} to attention, which cpctl's CP engine "
                             "does not compute; run this model with cp_size 1")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window, chunk = _layer_pattern(module, kwargs.get("sliding_window"))
    if window is not None and not causal:
        window += 1  # transformers' bidirectional window counts |q - k| <= window, the causal one q - k < window
    out = runtime.step_attention(query, key, value, is_causal=bool(causal), scale=scaling,
                                 enable_gqa=query.shape[1] != key.shape[1], window=window, chunk=chunk)
    return out.transpose(1, 2).contiguous(), None


def _layer_pattern(module: nn.Module, sliding_window: int | None) -> tuple[int | None, int | None]:
    """(window, chunk) of this attention layer, from what it passed and its config's layer_types."""
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    layer_idx = getattr(module, "layer_idx", None)
    kind = layer_types[layer_idx] if layer_types and isinstance(layer_idx, int) and layer_idx < len(layer_types) else None
    window, chunk = sliding_window, None
    if kind == "sliding_attention" and window is None:
        window = getattr(config, "sliding_window", None)
    elif kind == "chunked_attention":
        chunk = getattr(config, "attention_chunk_size", None)
    if kind in ("sliding_attention", "chunked_attention") and window is None and chunk is None:
        raise CpctlError(f"layer {layer_idx} is {kind} but its config sets no size for it")
    if kind is None and sliding_window is None and getattr(config, "attention_chunk_size", None):
        raise CpctlError(f"{type(module).__name__}: the config sets attention_chunk_size but no layer_types say which "
                         "layers use it; cpctl cannot tell chunked layers from full ones")
    return window, chunk


# ---------------------------------------------------------------------------- the model's forward


def _before_forward(model: nn.Module, args: tuple, kwargs: dict, runtime: RuntimeView):
    if not runtime.cp_active:
        return None
    if _checkpointing_on(model):
        raise CpctlError("gradient_checkpointing_enable() after rt.prepare_model: its recompute would not run across "
                         "the CP group; enable it before prepare_model, or set activation_checkpointing: true")
    kwargs = dict(kwargs)
    names = list(inspect.signature(model.forward).parameters)
    for name, value in zip(names, args):  # positional arguments, by name
        kwargs[name] = value
    tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    if tokens is None:
        raise CpctlError("a Hugging Face model under context parallelism needs input_ids or inputs_embeds")
    batch, local_len = tokens.shape[0], tokens.shape[1]
    from cpctl.integrations import hf_padding

    hf_padding.require_2d(kwargs.get("attention_mask"))
    for name in ("input_ids", "inputs_embeds", "position_ids", "labels", "shift_labels", "attention_mask"):
        runtime.require_sharded(kwargs.get(name), name=name, seq_dim=1)

    # As transformers: position ids restarting mean packed documents only where no mask is given.
    reads_documents = kwargs.get("attention_mask") is None and not _builds_cache(model, kwargs)
    hf_padding.adapt(kwargs, runtime, local_len=local_len, device=tokens.device)  # the mask -> hidden keys
    if kwargs.get("use_cache"):
        raise CpctlError("use_cache=True under context parallelism: a KV cache of a shard is no use; pass use_cache=False")
    kwargs["use_cache"] = False
    if getattr(model, "_cpctl_calls_sdpa", False):
        if kwargs.get("output_attentions"):
            raise CpctlError(f"output_attentions=True: {type(model).__name__} then computes attention without SDPA, "
                             "which cpctl cannot route; leave it out")
        kwargs["attention_mask"] = MODEL_CAUSAL_MASK  # its SDPA calls read it as the causal mask
        model._cpctl_calls_before = runtime.attention_calls
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        # RoPE must see where each token sits in the whole sequence, not in this shard.
        full = torch.arange(local_len * runtime.seq_size, device=tokens.device).expand(batch, -1)
        kwargs["position_ids"] = runtime.shard(full, seq_dim=1)
    elif reads_documents:
        runtime.adopt_position_ids(position_ids)
    has_labels = kwargs.get("labels") is not None
    # A caller's own num_items_in_batch (checked in _loss_arguments) means it normalizes the loss itself.
    model._cpctl_owns_loss = has_labels and kwargs.get("num_items_in_batch") is None
    if has_labels:
        kwargs.update(_loss_arguments(model, kwargs, runtime))
    return (), kwargs


def _builds_cache(model: nn.Module, kwargs: dict) -> bool:
    """Whether transformers, in one process, would run this call with a KV cache. It then reads
    no packed documents from the position ids (masking_utils looks for them only without a cache
    and without an attention_mask), so neither does cpctl."""
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        return True
    use_cache = kwargs.get("use_cache")
    if use_cache is None:  # transformers' merge_with_config_defaults: the config's value
        use_cache = getattr(model.config, "use_cache", None)
    if use_cache and getattr(model, "_cpctl_cache_off_in_training", False) and model.training and torch.is_grad_enabled():
        return False  # its own gradient checkpointing (which cpctl's replaced) turns the cache off
    return bool(use_cache)


def _loss_arguments(model: nn.Module, kwargs: dict, runtime: RuntimeView) -> dict:
    """What makes the model's own `.loss` the single-process one: labels shifted across shard
    boundaries, and a divisor that turns FSDP's gradient average into the global token mean."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    if getattr(model, "loss_function", None) is not ForCausalLMLoss:
        raise CpctlError(f"{type(model).__name__}(labels=...) under context parallelism: cpctl makes only the causal-LM "
                         "loss exact; compute the loss from the logits and use rt.token_mean")
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values()):
        raise CpctlError(f"{type(model).__name__}.forward takes no loss keywords; compute the loss with rt.token_mean")
    if kwargs.get("output_router_logits", getattr(model.config, "output_router_logits", False)):
        raise CpctlError("output_router_logits under context parallelism: the router's auxiliary loss would average "
                         "per shard; set output_router_logits=False (or add a global aux loss yourself)")
    shifted = kwargs.get("shift_labels")
    if shifted is None:
        shifted = runtime.shift_sharded(kwargs["labels"], ignore_index=IGNORE_INDEX)
    if kwargs.get("num_items_in_batch") is not None:
        if runtime.seq_size > 1 and not runtime.caller_counts_tokens:
            raise CpctlError("num_items_in_batch under context parallelism: leave it out, cpctl averages over every "
                             "token of the dp x cp batch (a count made before sharding counts each token once per "
                             "CP rank)")
        # The transformers Trainer's own normalization: the local sum over its count, scaled so
        # that the gradient average over dp x cp gives the global mean. Only the labels needed
        # shifting across shard boundaries.
        return {"shift_labels": shifted}
    tokens = (shifted != IGNORE_INDEX).sum().float()
    runtime.reduce_over_dp_cp(tokens)
    ranks = runtime.axes["dp_cp"].size()
    return {"shift_labels": shifted, "num_items_in_batch": tokens.clamp(min=1) / ranks}


def _after_forward(model: nn.Module, output: Any, runtime: RuntimeView):
    if getattr(model, "_cpctl_calls_sdpa", False) and runtime.cp_active:
        if runtime.attention_calls == getattr(model, "_cpctl_calls_before", runtime.attention_calls):
            raise CpctlError(f"{type(model).__name__} computed attention without calling scaled_dot_product_attention "
                             "under context parallelism, so cpctl could not route it; build it with "
                             "attn_implementation=\"sdpa\"")
    if not getattr(model, "_cpctl_owns_loss", False) or getattr(output, "loss", None) is None:
        return None
    model._cpctl_owns_loss = False
    # Each rank holds its share (local sum / (tokens / ranks)); their mean is the global token
    # mean. Show that value on every rank, keep this rank's share for the gradient.
    loss = output.loss
    mean = loss.detach().clone()
    runtime.reduce_over_dp_cp(mean)
    output.loss = loss + (mean / runtime.axes["dp_cp"].size() - loss.detach())
    return output


# ---------------------------------------------------------------------------- a loss without full logits


def causal_lm_loss(model: nn.Module, runtime: RuntimeView, *, input_ids: torch.Tensor, labels: torch.Tensor,
                   chunk_tokens: int, **kwargs: Any) -> torch.Tensor:
    """The model's causal-LM loss (the global token mean) from its final hidden states and its
    output embedding, chunk by chunk: the full logits are never built. `labels` as for
    `model(labels=...)`: unshifted, sharded like `input_ids` under CP."""
    from cpctl.runtime.losses import chunked_linear_cross_entropy

    head = model.get_output_embeddings()
    decoder = _decoder(model)
    if head is None or decoder is None:
        raise CpctlError(f"{type(model).__name__} has no output embedding and decoder to take a chunked loss from; "
                         "compute the loss from its logits with rt.token_mean")
    captured: list[torch.Tensor] = []
    hook = decoder.register_forward_hook(lambda module, args, output: captured.append(
        output[0] if isinstance(output, tuple) else output.last_hidden_state))
    try:  # logits for the last token only: the check below, not the loss
        output = model(input_ids=input_ids, use_cache=False, logits_to_keep=1, **kwargs)
    finally:
        hook.remove()
    hidden = captured[-1]
    transform = _logit_transform(model.config)
    _check_logits(output.logits[:, -1], hidden[:, -1], head, transform, model)
    shifted = runtime.shift_sharded(labels, ignore_index=IGNORE_INDEX) if runtime.cp_active else _shift(labels)
    loss_sum = chunked_linear_cross_entropy(hidden, head.weight, shifted, bias=head.bias, chunk_tokens=chunk_tokens,
                                            ignore_index=IGNORE_INDEX, transform=transform)
    return runtime.token_mean(loss_sum, shifted)


def _decoder(model: nn.Module) -> nn.Module | None:
    """The module whose output is the final hidden states (`model.model` in most causal LMs)."""
    for candidate in (getattr(model, "get_decoder", lambda: None)(), getattr(model, "model", None), model.base_model):
        if isinstance(candidate, nn.Module) and candidate is not model:
            return candidate
    return None


def _shift(labels: torch.Tensor) -> torch.Tensor:
    from cpctl.runtime.data import shift_labels

    return shift_labels(labels, ignore_index=IGNORE_INDEX)


def _logit_transform(config):
    """What transformers' causal LMs do to lm_head's output before the loss, from their configs."""
    steps = []
    if getattr(config, "logit_scale", None) not in (None, 1, 1.0):  # Cohere
        steps.append(lambda logits, s=config.logit_scale: logits * s)
    if getattr(config, "logits_scaling", None) not in (None, 1, 1.0):  # Granite
        steps.append(lambda logits, s=config.logits_scaling: logits / s)
    if getattr(config, "final_logit_softcapping", None) is not None:  # Gemma 2 and 3
        steps.append(lambda logits, c=config.final_logit_softcapping: torch.tanh(logits / c) * c)
    if not steps:
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        for step in steps:
            logits = step(logits)
        return logits

    return transform


def _check_logits(model_logits, last_hidden, head, transform, model) -> None:
    """The model's own logits of the last token against ours: a model that changes its logits in
    a way cpctl does not know would otherwise train on a different loss, silently."""
    with torch.no_grad():
        ours = head(last_hidden)
        ours = transform(ours) if transform is not None else ours
        gap = (ours.float() - model_logits.float()).abs().max().item()
        scale = model_logits.float().abs().max().item() + 1.0
    if gap > 1e-3 * scale:
        raise CpctlError(f"{type(model).__name__} computes its logits in a way cpctl's chunked loss does not "
                         f"reproduce (gap {gap:.3g}); compute the loss from model(...).logits with rt.token_mean")
