"""Route `torch.nn.functional.scaled_dot_product_attention` to the CP engine, for a while.

A TorchFunctionMode sees every SDPA call, however the caller spelled it (a Hugging Face
model looks the function up at call time; other code may have imported it by name), and
only inside the `with` block, only on this thread: nothing process-global is patched.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from cpctl.errors import CpctlError
from cpctl.upstream import Shape, shape_refusal

_SDPA = F.scaled_dot_product_attention
_MHA = F.multi_head_attention_forward
# nn.MultiheadAttention's functional form calls SDPA through this module-level name.
_MHA_SDPA_NAME = "scaled_dot_product_attention"
# What routing it relies on: a Python function (its code is run again with private globals) that
# takes need_weights (refused: weights are not SDPA's) and calls SDPA by that global name.
_MHA_SHAPE = Shape(parameters=("need_weights",), reads=(_MHA_SDPA_NAME,))


def _mha_refusal() -> str | None:
    """None when this torch's MHA can be routed (see _MHA_SHAPE), else the one line saying why not."""
    refusal = shape_refusal(F, _MHA.__name__, _MHA_SHAPE)
    if refusal is None and getattr(_MHA, "__globals__", {}).get(_MHA_SDPA_NAME) is not _SDPA:
        refusal = (f"torch.nn.functional.{_MHA.__name__} of torch {torch.__version__} calls another function by "
                   f"the name {_MHA_SDPA_NAME}")
    return refusal


_MHA_REFUSAL = _mha_refusal()  # checked once, as this module loads; told when an MHA call is routed
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

# The attention mask cpctl hands a model that calls SDPA itself with the mask transformers
# builds (Falcon): transformers passes a 4-D mask through unchanged, and an SDPA call inside
# the routing reads this one as "the model's causal mask over the whole sequence". Integer,
# so that anywhere else (a real SDPA call, added to scores) it fails loudly or is refused.
MODEL_CAUSAL_MASK = torch.zeros((1, 1, 1, 1), dtype=torch.int32)


def _bind(args, kwargs) -> dict:
    bound = dict(zip(_SDPA_PARAMS, args))
    bound.update(kwargs)
    bound.setdefault("attn_mask", None)
    bound.setdefault("dropout_p", 0.0)
    bound.setdefault("is_causal", False)
    bound.setdefault("scale", None)
    bound.setdefault("enable_gqa", False)
    return bound


def is_causal_mask(mask: torch.Tensor, q_len: int, k_len: int) -> bool:
    """True if `mask` (bool, or additive 0/-inf) allows exactly the lower triangle, for every batch and head."""
    if mask.shape[-2:] != (q_len, k_len) or q_len != k_len:
        return False
    allowed = mask if mask.dtype == torch.bool else mask == 0
    lower = torch.ones(q_len, k_len, dtype=torch.bool, device=mask.device).tril()
    return bool((allowed == lower).all())


_LOSSES = (F.cross_entropy, F.nll_loss)


def _check_loss(args, kwargs, cp_size: int, local_tokens: int | None) -> None:
    """Sharded logits against unsharded labels: say so, instead of torch's bare shape error. And a
    mean over a shard's tokens (the default reduction): the ranks' shards count different tokens
    (-100 labels, the last position, padding), so the mean of their means is not the sequence's."""
    logits = args[0] if args else kwargs.get("input")
    target = args[1] if len(args) > 1 else kwargs.get("target")
    if cp_size == 1 or not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor) or logits.dim() < 2:
        return
    tokens = logits.numel() // logits.shape[1]  # the class dim is dim 1
    if target.numel() == tokens * cp_size:
        raise CpctlError(
            f"the loss got {tokens} logits but {target.numel()} labels under context parallelism ({cp_size} ranks): "
            "the labels are not sharded; add them to maybe_context_parallel's buffers"
        )
    per_token = local_tokens is not None and target.numel() >= local_tokens and target.numel() % local_tokens == 0
    if per_token and _reduction(args, kwargs) == "mean":
        raise CpctlError(
            "cross_entropy with reduction='mean' inside maybe_context_parallel averages this rank's shard only, "
            "and the shards count different tokens; take reduction='sum' and rt.token_mean(loss_sum, labels), "
            "or the model's own .loss"
        )


def _reduction(args, kwargs) -> str:
    """cross_entropy's and nll_loss's reduction, the legacy size_average/reduce flags read as torch reads them."""
    size_average = kwargs.get("size_average", args[3] if len(args) > 3 else None)
    reduce = kwargs.get("reduce", args[5] if len(args) > 5 else None)
    if size_average is not None or reduce is not None:
        return torch.nn._reduction.legacy_get_string(size_average, reduce, emit_warning=False)
    return kwargs.get("reduction", args[6] if len(args) > 6 else "mean")


class RouteSDPA(TorchFunctionMode):
    """Inside: SDPA calls go to `attention(q, k, v, is_causal=..., scale=..., enable_gqa=...)`.

    `passes_masks()`: whether a call with a tensor mask may run unrouted, as it is (cp_size 1
    with nothing to add to the mask); otherwise only a causal mask is accepted, as `is_causal`.
    """

    def __init__(self, attention: Callable[..., torch.Tensor], *, cp_size: int = 1,
                 passes_masks: Callable[[], bool] = lambda: False, local_tokens: int | None = None):
        super().__init__()
        self.attention = attention
        self.cp_size = cp_size
        self.passes_masks = passes_masks
        self.local_tokens = local_tokens  # this rank's tokens per row of the step's buffers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _MHA:
            return self._multi_head_attention(func, args, kwargs)
        if func in _LOSSES:
            _check_loss(args, kwargs, self.cp_size, self.local_tokens)
        if func is not _SDPA:
            return func(*args, **kwargs)
        call = _bind(args, kwargs)
        q, k = call["query"], call["key"]
        is_causal = bool(call["is_causal"])
        mask = call["attn_mask"]
        if mask is MODEL_CAUSAL_MASK:
            mask, is_causal = None, True
        if mask is not None and self.passes_masks():  # nothing sharded: the mask covers the whole sequence
            return func(*args, **kwargs)
        if mask is not None:
            # A model handing SDPA an explicit causal mask (some Hugging Face paths do) means
            # plain causal attention; any other mask (padding, packing, sliding windows)
            # cannot be sharded by position and would be silently wrong.
            if is_causal or not is_causal_mask(mask, q.shape[-2], k.shape[-2]):
                raise CpctlError(
                    "scaled_dot_product_attention got a tensor attn_mask under context parallelism; "
                    "CP supports causal or full attention only: pass attn_mask=None (with is_causal=True "
                    "for causal). A Hugging Face model builds such a mask when cpctl does not compute its "
                    "attention: give the model itself to rt.prepare_model (before torch.compile or any "
                    "wrapper), and pad its batches on the right with labels -100"
                )
            is_causal = True
        if call["dropout_p"]:
            raise CpctlError(
                f"scaled_dot_product_attention with dropout_p={call['dropout_p']} under context parallelism; "
                "attention dropout is not supported with CP: set it to 0 (model.config.attention_dropout = 0.0)"
            )
        # One K/V head against several query heads is SDPA's broadcasting (Falcon's multi-query
        # attention): the same as GQA with every query head in one group.
        enable_gqa = bool(call["enable_gqa"]) or (k.dim() == 4 and k.shape[1] == 1 < q.shape[1])
        return self.attention(q, k, call["value"], is_causal=is_causal, scale=call["scale"], enable_gqa=enable_gqa)

    def _multi_head_attention(self, func, args, kwargs):
        """nn.MultiheadAttention (and so nn.TransformerEncoderLayer) under CP.

        Its functional form reaches this mode as one call, and the mode is off while it
        handles a call, so the inner SDPA call would run unrouted (attending to local tokens
        only); re-entering the mode would hand this same call back to it, forever. So the
        function's own code runs here with private globals in which its SDPA name is this
        routing: one function object per call, nothing shared is changed.
        """
        if _MHA_REFUSAL is not None:  # a torch whose MHA reaches SDPA another way
            raise CpctlError(f"nn.MultiheadAttention cannot be routed under context parallelism: {_MHA_REFUSAL}")
        call = inspect.signature(_MHA).bind(*args, **kwargs)
        call.apply_defaults()
        if call.arguments["need_weights"]:
            raise CpctlError(
                "nn.MultiheadAttention with need_weights=True under context parallelism computes attention "
                "weights without SDPA and cannot be sharded; call it with need_weights=False"
            )

        def routed(*a, **k):
            return self.__torch_function__(_SDPA, (), a, k)

        routed_mha = types.FunctionType(func.__code__, {**func.__globals__, _MHA_SDPA_NAME: routed},
                                        func.__name__, func.__defaults__, func.__closure__)
        routed_mha.__kwdefaults__ = func.__kwdefaults__
        return routed_mha(*call.args, **call.kwargs)
