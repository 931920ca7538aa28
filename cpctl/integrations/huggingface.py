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

Each prepared model has its own `PreparedModel`: the runtime it computes with, what its forward
needs to know, the hooks it acts through. transformers' attention and mask functions for
"cpctl" are registered once per process, through the patch registry (patches.py, undone with
every other change), and act for the prepared model whose forward calls them. So models
prepared in one process (a policy and a reference model, a PEFT model and another, models of
two runtimes) each compute with their own.

Packed documents are read from position ids exactly when transformers reads them in one
process: no attention_mask, no KV cache (use_cache off: the config's default, True, keeps
transformers from reading them), and a model that hands its position ids to transformers' mask
functions (OPT, BERT-style decoders build their masks without them: attention crosses documents).

A model whose forward takes no position_ids would number each shard from its own start: refused.

What cannot be expressed is refused before the first step, from the config, or at the call,
with the setting to change: never a silently different model. At cp_size 1 a model whose
config cannot be computed is left to transformers outside `maybe_context_parallel` (it is then
transformers' own model) and refused inside it, as under CP.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from cpctl.attention.dispatch import MODEL_CAUSAL_MASK
from cpctl import topology
from cpctl.errors import CpctlError
from cpctl.integrations import fsdp_saving
from cpctl.integrations.patches import PATCHES
from cpctl.upstream import Shape, module_uses, names_read, require_shape
from cpctl.runtime import adapters, losses
from cpctl.runtime.mesh import Axis
from cpctl.runtime.padding import IGNORE_INDEX

if TYPE_CHECKING:
    from cpctl.integrations.runtime_view import RuntimeView

IMPLEMENTATION = "cpctl"
# Layer kinds (config.layer_types) that call the attention function; anything else mixes
# tokens some other way (linear attention, state spaces, convolutions) that CP cannot shard.
ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")
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


class HuggingFaceAdapter:
    """transformers models as the runtime's preparation and losses ask for them (runtime/adapters.py)."""

    def model_in(self, model: nn.Module) -> nn.Module | None:
        return huggingface_model_in(model)

    def prepare(self, model: nn.Module, context: RuntimeView) -> bool:
        return prepare(model, context).had_checkpointing

    def unprepared_refused(self) -> contextlib.AbstractContextManager:
        return unprepared_models_refused()

    def causal_lm_loss_sum(self, model: nn.Module, context: RuntimeView, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_lm_loss_sum(model, context, **kwargs)


ADAPTER = HuggingFaceAdapter()


def register() -> None:
    """Make transformers models known to the runtime: `cpctl.init` calls it."""
    adapters.register(ADAPTER)


# ---------------------------------------------------------------------------- before the first step


def prepare(model: nn.Module, runtime: RuntimeView) -> PreparedModel:
    """Check `model`'s config for what CP cannot compute, then route its attention through cpctl
    with `runtime`. Returns the model's PreparedModel, whose hooks the model now carries.

    A model that had its own gradient checkpointing on has it turned off here (its recompute
    would run outside CP's routing): `had_checkpointing` tells the runtime to checkpoint the
    blocks instead.
    """
    fsdp_saving.install()  # once sharded, save_pretrained must gather before it writes
    config = model.config
    problems = [*_config_problems(config), *_sink_problems(model), *_position_problems(model),
                *_head_problems(config, sp_size=runtime.sp_size, tp_size=runtime.config.parallelism.tp_size)]
    problem = next(iter(problems), None)
    calls_sdpa = False
    if problem is None:
        _register_with_transformers()
        if _takes_attention_interface(model):
            model.set_attn_implementation(IMPLEMENTATION)
        if model.config._attn_implementation != IMPLEMENTATION:
            problem = _sdpa_call_problem(model)
            calls_sdpa = problem is None
    if problem is not None:
        problem = f"{type(model).__name__} cannot run under context parallelism: {problem}"
        if runtime.mesh.seq_enabled:
            raise CpctlError(problem)
        # cp_size 1: outside the context the model is transformers' own; inside, refused as under CP.
        _log.info("%s keeps transformers' attention (refused inside maybe_context_parallel): %s",
                  type(model).__name__, problem)
        prepared = PreparedModel(runtime, refusal=problem)
    else:
        checkpointing = _checkpointing_on(model)
        if checkpointing:
            model.gradient_checkpointing_disable()
        prepared = PreparedModel(runtime, calls_sdpa=calls_sdpa, had_checkpointing=checkpointing,
                                 counts_positions_from_padding=_counts_positions_from_padding(model),
                                 chunks_by_row=_chunks_by_row(model))
    prepared.attach(model)
    return prepared


def _takes_attention_interface(model: nn.Module) -> bool:
    """transformers' own test (5.x): whether set_attn_implementation can switch this model."""
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    return bool(can_set()) if callable(can_set) else True


def _sdpa_call_problem(model: nn.Module) -> str | None:
    """None when a model that takes no attention implementation calls SDPA itself on a plain causal
    mask, which cpctl then routes; else why cpctl cannot see its attention."""
    config = model.config
    if config._attn_implementation != "sdpa":
        if not getattr(type(model), "_supports_sdpa", True):  # XGLM, GPT-Neo, ...: asking for sdpa fails
            return (f"its attention is {config._attn_implementation!r} only (transformers has no SDPA for it) and it "
                    "does not take transformers' AttentionInterface; run it at cp_size 1")
        return (f"its attention is {config._attn_implementation!r} and it does not take transformers' "
                "AttentionInterface; build it with attn_implementation=\"sdpa\"")
    if not module_uses(sys.modules.get(type(model).__module__), "scaled_dot_product_attention"):
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


def _sink_problems(model: nn.Module) -> Iterator[str]:
    """Learned attention sinks (gpt-oss' `sinks`, handed to attention as `s_aux`) add a logit per head
    to every softmax; neither cpctl's engine nor the SDPA it stands in for computes them."""
    sinks = next((name for name, _ in model.named_parameters() if name.rsplit(".", 1)[-1] in ("sinks", "s_aux")), None)
    if sinks is not None:
        yield (f"its attention adds learned sinks ({sinks}) to each softmax, which cpctl's engine does not compute; "
               "run it outside maybe_context_parallel, at cp_size 1")


def _position_problems(model: nn.Module) -> Iterator[str]:
    """cpctl hands a model where each token sits in the whole sequence through `position_ids`; a
    forward that takes none (BART-style decoders, Whisper's, MPT, xLSTM) would number a shard's
    tokens from its own start, silently."""
    # the class's forward: an instance's may be wrapped with (*args, **kwargs) (accelerate's output casting)
    if "position_ids" not in inspect.signature(type(model).forward).parameters:
        yield ("its forward takes no position_ids, so it would place each shard's tokens by the shard's own "
               "length (learned, sinusoidal or ALiBi positions, or a recurrence); run it at cp_size 1")


def _counts_positions_from_padding(model: nn.Module) -> bool:
    """Whether the model's embeddings derive default positions from its padding token: transformers
    gives that family (RoBERTa, XLM-R, CamemBERT, ESM, ...) `create_position_ids_from_input_ids`."""
    return any(callable(getattr(module, "create_position_ids_from_input_ids", None)) for module in model.modules())


def _made_on_the_shard(position_ids: torch.Tensor, runtime: RuntimeView, *, local_len: int) -> bool:
    """Whether every CP rank holds 0, 1, ..., local_len - 1: `torch.arange` of the shard, a common
    mistake. Checked where no true layout can look so: ring chunks placed head-tail (the default)
    without Ulysses, where rank r holds chunks r and 2 cp - 1 - r, so that on every rank at once it
    would need a document to start at position chunk_len (packing starts each at 0). Collective."""
    parallelism = runtime.config.parallelism
    if runtime.seq_size == 1 or runtime.sp_size > 1 or not parallelism.cp_load_balance:
        return False
    shard_arange = torch.arange(local_len, device=position_ids.device)
    return runtime.every_seq_rank(bool((position_ids == shard_arange).all()))


def _chunks_by_row(model: nn.Module) -> bool:
    """Whether transformers, in one process, would place this model's attention chunks by row
    position across packed documents (releases before `remap_positions_for_packed_sequence`)."""
    from transformers import masking_utils

    chunked = "chunked_attention" in (getattr(model.config, "layer_types", None) or ())
    return chunked and not hasattr(masking_utils, "remap_positions_for_packed_sequence")


def _head_problems(config, *, sp_size: int, tp_size: int) -> Iterator[str]:
    """Ulysses splits each rank's attention heads over sp ranks: they must divide evenly. (K/V heads
    need not: fewer than sp are replicated, exactly.)"""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    problem = topology.heads_split_problem(heads, sp=sp_size, tp=tp_size) if isinstance(heads, int) else None
    if problem is not None:
        yield problem


def _register_with_transformers() -> None:
    """The "cpctl" attention and mask functions, once per process, through the patch registry."""
    from transformers import AttentionInterface, masking_utils
    from transformers.masking_utils import AttentionMaskInterface

    for registry, function in ((AttentionInterface, attention), (AttentionMaskInterface, mask)):
        if not PATCHES.is_patched(registry, IMPLEMENTATION):
            PATCHES.register(registry, IMPLEMENTATION, function,
                             why="cpctl's attention for prepared models: the CP engine inside maybe_context_parallel")
    if not PATCHES.is_patched(masking_utils, "find_packed_sequence_indices"):
        # its mask functions look for packed documents through this name: only there does transformers
        # read them in one process (a model that builds its mask without its position ids never does)
        require_shape(masking_utils, "_preprocess_mask_arguments", Shape(reads=("find_packed_sequence_indices",)))
        PATCHES.replace(masking_utils, "find_packed_sequence_indices", _reading_packed_documents,
                        why="packed documents under CP exactly where transformers reads them from position ids",
                        needs=Shape(parameters=("position_ids",)))


def _reading_packed_documents(original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' search for packed documents in a mask function's position ids; under CP the
    prepared forward's own (sharded, whole-sequence) position ids become the step's documents, and
    transformers gets none: cpctl's engine masks them, and its mask function builds no mask."""

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        forward = _RUNNING[-1] if _RUNNING else None
        if forward is None or not forward.prepared.runtime.cp_active:
            return original(position_ids)
        if forward.documents_from is not None:
            packed = forward.prepared.runtime.adopt_position_ids(forward.documents_from)
            forward.documents_from = None
            if packed and forward.prepared.chunks_by_row:
                raise CpctlError("this transformers release places a packed row's attention chunks by the row's "
                                 "positions, across documents, where cpctl places them in each document (as "
                                 "transformers 5.24 does); upgrade transformers, or pass an all-ones attention_mask "
                                 "to train across documents")
        return None

    return find_packed_sequence_indices


# ---------------------------------------------------------------------------- masks and attention


@dataclass
class _Forward:
    """One forward of a prepared model, from its pre-hook to its hook (always called, errors too)."""

    prepared: PreparedModel
    engine_calls_before: int | None = None  # under CP: the engine's count at its start (it must call attention)
    shifted_labels: torch.Tensor | None = None  # set when cpctl makes its loss (this shard's sum) the batch's mean
    # the position ids it was called with, where transformers would read packed documents from them,
    # until its mask function looks for them (_reading_packed_documents)
    documents_from: torch.Tensor | None = None


# The prepared models' forwards in progress, innermost last: transformers calls the attention and
# mask functions by name, once registered for the process, so they act for the forward calling them.
_RUNNING: list[_Forward] = []
# Each attention layer -> the PreparedModel it last ran under CP with: a checkpointed block's
# recompute runs in backward, after its model's forward (and its _Forward) ended.
_LAYER_OWNER: weakref.WeakKeyDictionary[nn.Module, PreparedModel] = weakref.WeakKeyDictionary()


# What torch.compile's OptimizedModule says when a global module hook is registered (its start).
_COMPILE_GLOBAL_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"

# The pre-hooks of prepared models (a deep copy of a model carries the same functions).
_PREPARED_HOOKS: weakref.WeakSet[Any] = weakref.WeakSet()


@contextlib.contextmanager
def unprepared_models_refused() -> Iterator[None]:
    """Inside, a transformers model that cpctl did not prepare is one line when it is called on its
    own: on a shard it would compute positions and masks of the shard, not of the sequence. Models
    called inside a prepared one's forward (its backbone) are the prepared model's."""
    if "transformers" not in sys.modules:
        yield
        return
    from transformers import PreTrainedModel

    def refuse_unprepared(module: nn.Module, args: tuple) -> None:
        if _RUNNING or not isinstance(module, PreTrainedModel):
            return
        if any(hook in _PREPARED_HOOKS for hook in module._forward_pre_hooks.values()):
            return  # prepared: its own pre-hook, which runs next, takes it from here
        raise CpctlError(f"{type(module).__name__} runs inside maybe_context_parallel on a shard of the sequence, "
                         "but cpctl did not prepare it: its positions and masks would be the shard's; give it to "
                         "rt.prepare_model first (the transformers model itself or its PEFT model, not a wrapper "
                         "around it), or call it outside the context")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(refuse_unprepared)
    # torch.compile's wrapper warns of any global hook (it runs once more, for the wrapper); this
    # one returns at once for a module that is not a transformers model: said for nothing
    before = list(warnings.filters)
    warnings.filterwarnings("ignore", message=_COMPILE_GLOBAL_HOOK_WARNING)
    quiet = warnings.filters[0]
    added = quiet not in before  # the same filter already there (a step inside a step, the user's) stays
    try:
        yield
    finally:
        handle.remove()
        if added:
            with contextlib.suppress(ValueError):  # an "ignore" filter left no trace in any once-registry
                warnings.filters.remove(quiet)


def _routing_runtime(layer: nn.Module | None = None) -> RuntimeView | None:
    """The runtime whose maybe_context_parallel computes this call's attention; None: transformers' "sdpa"."""
    if _RUNNING:
        prepared = _RUNNING[-1].prepared
    else:  # a checkpointed block's recompute
        prepared = _LAYER_OWNER.get(layer) if layer is not None else None
    if prepared is None or not prepared.runtime.cp_active:
        return None
    if layer is not None and _RUNNING:
        _LAYER_OWNER[layer] = prepared
    return prepared.runtime


def mask(*args: Any, attention_mask: torch.Tensor | None = None, use_vmap: bool = False, **kwargs: Any):
    """transformers' mask hook: under CP build nothing (the engine knows each layer's pattern)."""
    from transformers.masking_utils import sdpa_mask

    runtime = _routing_runtime()
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

    runtime = _routing_runtime(module)
    unsupported = next((name for name in ("softcap", "position_bias", "s_aux", "sinks") if kwargs.get(name) is not None),
                       None)
    if unsupported is not None:  # outside a step too: SDPA would drop it silently
        raise CpctlError(f"{type(module).__name__} passes {unsupported} to attention, which cpctl's attention does not "
                         "compute; run this model outside maybe_context_parallel, at cp_size 1")
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


class PreparedModel:
    """cpctl's side of one prepared transformers model: the runtime it computes with, what its
    forward needs to know, and the hooks through which it acts (attach).

    Nothing of it lives on the model but its hooks, and nothing in this module's globals but
    the forwards in progress, so every prepared model computes with its own. The hooks close
    over it: a copy.deepcopy of the model (TRL's reference models) shares it and its runtime,
    where bound methods would be deep-copied with the runtime's process groups.
    """

    def __init__(self, runtime: RuntimeView, *, calls_sdpa: bool = False, had_checkpointing: bool = False,
                 counts_positions_from_padding: bool = False, chunks_by_row: bool = False,
                 refusal: str | None = None) -> None:
        self.runtime = runtime
        # It takes no attention implementation but calls SDPA itself (Falcon): under CP it is handed
        # MODEL_CAUSAL_MASK, and its SDPA calls are routed like any other code's.
        self.calls_sdpa = calls_sdpa
        # Its own gradient checkpointing was on (prepare turned it off; the runtime checkpoints its
        # blocks instead): transformers would have trained it without a KV cache.
        self.had_checkpointing = had_checkpointing
        # Left without position_ids it numbers its tokens from padding_idx + 1, skipping pads (RoBERTa
        # and its kin), not 0, 1, 2, ... as cpctl would fill them in.
        self.counts_positions_from_padding = counts_positions_from_padding
        # At cp_size 1, why it keeps transformers' attention: then refused inside maybe_context_parallel.
        self.refusal = refusal
        # It has chunked attention layers, and this transformers places chunks by row position in
        # packed rows (before remap_positions_for_packed_sequence): cpctl places them per document.
        self.chunks_by_row = chunks_by_row

    def attach(self, model: nn.Module) -> None:
        """Put this model's hooks on `model` (the transformers model itself, inside any PEFT wrapper)."""
        if self.refusal is not None:
            hook = lambda module, args: self._refuse_inside()  # noqa: E731
            _PREPARED_HOOKS.add(hook)
            model.register_forward_pre_hook(hook)
            return
        # Python checks and bookkeeping, run as they are under torch.compile (dynamo would trace the
        # checks' collectives and .item() calls, and warn of the graph breaks they make)
        hook = torch.compiler.disable(lambda module, args, kwargs: self._before_forward(module, args, kwargs))
        _PREPARED_HOOKS.add(hook)
        model.register_forward_pre_hook(hook, with_kwargs=True)
        # Always called, errors too: it ends the _Forward the pre-hook began.
        after = torch.compiler.disable(lambda module, args, output: self._after_forward(module, output))
        model.register_forward_hook(after, always_call=True)

    def _refuse_inside(self) -> None:
        if self.runtime.cp_active:
            raise CpctlError(self.refusal)

    def _before_forward(self, model: nn.Module, args: tuple, kwargs: dict):
        forward = _Forward(self)
        _RUNNING.append(forward)  # first: _after_forward, always called, takes it off
        runtime = self.runtime
        if not runtime.cp_active:
            return None
        if _checkpointing_on(model):
            raise CpctlError("gradient_checkpointing_enable() after rt.prepare_model: its recompute would not run "
                             "across the CP group; enable it before prepare_model, or set activation_checkpointing: true")
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

        # As transformers: position ids restarting mean packed documents only where no mask is given
        # (and the model hands them to its mask function: _reading_packed_documents).
        reads_documents = kwargs.get("attention_mask") is None and not self._builds_cache(model, kwargs)
        hf_padding.adapt(kwargs, runtime, local_len=local_len, device=tokens.device)  # the mask -> hidden keys
        if kwargs.get("use_cache"):
            raise CpctlError("use_cache=True under context parallelism: a KV cache of a shard is no use; "
                             "pass use_cache=False")
        kwargs["use_cache"] = False
        forward.engine_calls_before = runtime.attention_calls
        if self.calls_sdpa:
            if kwargs.get("output_attentions"):
                raise CpctlError(f"output_attentions=True: {type(model).__name__} then computes attention without "
                                 "SDPA, which cpctl cannot route; leave it out")
            kwargs["attention_mask"] = MODEL_CAUSAL_MASK  # its SDPA calls read it as the causal mask
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and _made_on_the_shard(position_ids, runtime, local_len=local_len):
            raise CpctlError("position_ids made on the shard: every CP rank passed 0..{} for its own {} tokens; "
                             "make them for the whole row before sharding (cpctl.position_ids_like(ids) among "
                             "maybe_context_parallel's buffers), or leave them out".format(local_len - 1, local_len))
        if position_ids is None and self.counts_positions_from_padding:
            if runtime.seq_size > 1:
                raise CpctlError(f"{type(model).__name__} numbers its tokens from its padding token when position_ids "
                                 "are left out (padding_idx + 1 on, skipping pads), which a shard cannot tell; pass "
                                 "the whole sequence's position_ids, sharded with the batch")
            # one rank holds the whole sequence: the model numbers it as in one process
        elif position_ids is None:
            # RoPE must see where each token sits in the whole sequence, not in this shard.
            full = torch.arange(local_len * runtime.seq_size, device=tokens.device).expand(batch, -1)
            kwargs["position_ids"] = runtime.shard(full, seq_dim=1)
        elif reads_documents and self.calls_sdpa and runtime.adopt_position_ids(position_ids):
            # It builds the mask it hands SDPA itself, and whether that reads documents from position ids
            # is its release's choice (Falcon: transformers 5.24 does, 5.17 does not); cpctl cannot see it.
            raise CpctlError(f"{type(model).__name__} builds its attention mask itself, and whether that keeps "
                             "packed documents apart depends on the transformers release; say which you mean: "
                             "maybe_context_parallel(documents=position_ids) for attention inside each document, "
                             "or an all-ones attention_mask for attention across them")
        elif reads_documents:
            forward.documents_from = position_ids
        if kwargs.get("labels") is not None:
            kwargs.update(self._loss_arguments(model, kwargs, forward))
        return (), kwargs

    def _builds_cache(self, model: nn.Module, kwargs: dict) -> bool:
        """Whether transformers, in one process, would run this call with a KV cache. It then reads
        no packed documents from the position ids (masking_utils looks for them only without a cache
        and without an attention_mask), so neither does cpctl."""
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            return True
        use_cache = kwargs.get("use_cache")
        if use_cache is None:  # transformers' merge_with_config_defaults: the config's value
            use_cache = getattr(model.config, "use_cache", None)
        if use_cache and self.had_checkpointing and model.training and torch.is_grad_enabled():
            return False  # its own gradient checkpointing (which cpctl's replaced) turns the cache off
        return bool(use_cache)

    def _loss_arguments(self, model: nn.Module, kwargs: dict, forward: _Forward) -> dict:
        """What makes the model's own `.loss` the single-process one: labels shifted across shard
        boundaries and, unless the caller counts the tokens itself, a loss summed over this shard's
        tokens, which _after_forward makes the batch's token mean."""
        from transformers.loss.loss_utils import ForCausalLMLoss

        runtime = self.runtime
        if getattr(model, "loss_function", None) is not ForCausalLMLoss or not _computes_loss_function(model):
            raise CpctlError(f"{type(model).__name__}(labels=...) under context parallelism: cpctl makes only the "
                             "causal-LM loss exact; compute the loss from the logits and use rt.token_mean")
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values()):
            raise CpctlError(f"{type(model).__name__}.forward takes no loss keywords; compute the loss with rt.token_mean")
        if kwargs.get("output_router_logits", getattr(model.config, "output_router_logits", False)):
            raise CpctlError("output_router_logits under context parallelism: the router's auxiliary loss would average "
                             "per shard; set output_router_logits=False (or add a global aux loss yourself)")
        shifted = kwargs.get("shift_labels")
        if shifted is None:
            shifted = runtime.shift_sharded(kwargs["labels"], ignore_index=IGNORE_INDEX)
        if kwargs.get("num_items_in_batch") is not None:
            if runtime.mesh.seq_enabled and not runtime.caller_counts_tokens:
                raise CpctlError("num_items_in_batch under context parallelism: leave it out, cpctl averages over every "
                                 "token of the dp x cp batch (a count made before sharding counts each token once per "
                                 "CP rank)")
            # The transformers Trainer's own normalization: the local sum over its count, scaled so
            # that the gradient average over dp x cp gives the global mean. Only the labels needed
            # shifting across shard boundaries.
            return {"shift_labels": shifted}
        forward.shifted_labels = shifted
        return {"shift_labels": shifted, "num_items_in_batch": 1}  # transformers' loss: the sum over 1

    def _after_forward(self, model: nn.Module, output: Any):
        forward = _RUNNING.pop() if _RUNNING and _RUNNING[-1].prepared is self else None
        if forward is None or output is None:  # the forward raised: nothing of it to check or finish
            return None
        runtime = self.runtime
        if forward.engine_calls_before is not None and runtime.attention_calls == forward.engine_calls_before:
            # each shard alone: whatever mixed its tokens (its own attention code, a recurrence) saw no other
            raise CpctlError(f"{type(model).__name__} ran a forward under context parallelism without one attention "
                             "call through cpctl, so its tokens never met the other shards'; build it with "
                             "attn_implementation=\"sdpa\", or run it at cp_size 1")
        if forward.shifted_labels is None:  # no labels, or the caller counts the tokens itself
            return None
        as_tuple = isinstance(output, tuple)  # return_dict=False: the loss comes first
        loss_sum = output[0] if as_tuple else getattr(output, "loss", None)
        if loss_sum is None:
            return None
        # This shard's sum becomes the batch's token mean on every rank, with the gradient that
        # FSDP's average over the dp x cp ranks makes the single-process one.
        loss = losses.token_mean(loss_sum, forward.shifted_labels, group=runtime.mesh.axes[Axis.DP_CP],
                                 ignore_index=IGNORE_INDEX)
        if as_tuple:
            return (loss, *output[1:])
        output.loss = loss
        return output


# ---------------------------------------------------------------------------- a loss without full logits


def causal_lm_loss_sum(model: nn.Module, runtime: RuntimeView, *, input_ids: torch.Tensor, labels: torch.Tensor,
                       chunk_tokens: int, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's causal-LM loss summed over this rank's tokens, from its final hidden states and
    its output embedding, chunk by chunk: the full logits are never built; and the shifted labels
    it counted (the runtime's step_losses makes the two the global token mean). `labels` as for
    `model(labels=...)`: unshifted, sharded like `input_ids` under CP."""
    head = model.get_output_embeddings()
    decoder = _decoder(model)
    if head is None or decoder is None:
        raise CpctlError(f"{type(model).__name__} has no output embedding and decoder to take a chunked loss from; "
                         "compute the loss from its logits with rt.token_mean")
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        # the chunks use its weight and bias only: a head of its own (a learned logit scale) would be skipped
        raise CpctlError(f"{type(model).__name__}'s output head {type(head).__name__} is not a plain linear layer, so "
                         "cpctl's chunked loss cannot compute it; compute the loss from its logits with rt.token_mean")
    captured: list[Any] = []
    hook = decoder.register_forward_hook(lambda module, args, output: captured.append(
        output if isinstance(output, torch.Tensor) else output[0] if isinstance(output, tuple)
        else getattr(output, "last_hidden_state", None)))
    try:  # logits for the last token only: the check below, not the loss
        output = model(input_ids=input_ids, use_cache=False, logits_to_keep=1, **kwargs)
    finally:
        hook.remove()
    hidden = captured[-1] if captured else None
    if not isinstance(hidden, torch.Tensor) or hidden.shape[:2] != input_ids.shape[:2]:
        raise CpctlError(f"{type(model).__name__}: cpctl found no final hidden states (one per token) to take a "
                         "chunked loss from; compute the loss from its logits with rt.token_mean")
    transform = _logit_transform(model.config)
    _check_logits(output.logits[:, -1], hidden[:, -1], head, transform, model)
    shifted = runtime.shift_sharded(labels, ignore_index=IGNORE_INDEX) if runtime.cp_active else _shift(labels)
    loss_sum = losses.chunked_linear_cross_entropy(hidden, head.weight, shifted, bias=head.bias,
                                                   chunk_tokens=chunk_tokens, ignore_index=IGNORE_INDEX,
                                                   transform=transform)
    return loss_sum, shifted


def _computes_loss_function(model: nn.Module) -> bool:
    """Whether the model's forward takes its loss from `self.loss_function` (which then gets cpctl's
    shift_labels), not a loss of its own: transformers answers ForCausalLMLoss for any model without a
    loss_type, so only the forward's code tells (BART-style decoders use CrossEntropyLoss, unshifted)."""
    forward = inspect.unwrap(type(model).forward)
    code = getattr(forward, "__code__", None)
    return code is not None and "loss_function" in names_read(code)


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
        ours = nn.functional.linear(last_hidden, head.weight, head.bias)
        ours = transform(ours) if transform is not None else ours
        gap = (ours.float() - model_logits.float()).abs().max().item()
        scale = model_logits.float().abs().max().item() + 1.0
    # the same product on the same numbers: in full fp32 a transform cpctl does not know shows above
    # rounding (a logit scale of 1.0005 as much as one of 2); elsewhere (TF32, half precision) 1e-3 of the scale
    full_fp32 = (model_logits.dtype in (torch.float32, torch.float64) and torch.get_float32_matmul_precision() == "highest"
                 and not (model_logits.is_cuda and torch.backends.cuda.matmul.allow_tf32))
    tolerance = 1e-5 if full_fp32 else 1e-3
    if gap > tolerance * scale:
        raise CpctlError(f"{type(model).__name__} computes its logits in a way cpctl's chunked loss does not "
                         f"reproduce (gap {gap:.3g}); compute the loss from model(...).logits with rt.token_mean")
