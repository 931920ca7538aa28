"""What to turn on when a step does not fit: the memory options that lower the need, alone and
together, and the fewest GPUs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cpctl.planner.fit import Estimate, estimate, gpus_needed
from cpctl.planner.setup import Setup
from cpctl.planner.units import GiB


@dataclass(frozen=True)
class Suggestion:
    what: str  # the option, as the user turns it on
    changes: dict[str, Any]  # Setup fields
    estimate: Estimate

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "changes": self.changes, "needed_gib": round(self.estimate.needed / GiB, 3),
                "fits": self.estimate.fits}


def _options_to_try(setup: Setup, *, available: frozenset[str]) -> list[tuple[str, dict[str, Any], bool]]:
    """Memory options that are off in `setup`: (flag, Setup changes, slow), those that cost
    little speed first."""
    options: list[tuple[str, dict[str, Any], bool]] = []
    if not setup.activation_checkpointing:
        options.append(("--activation-checkpointing true", {"activation_checkpointing": True}, False))
    if not setup.chunked_loss:
        options.append(("a chunked loss: rt.causal_lm_loss (--chunked-loss here)", {"chunked_loss": True}, False))
    if not setup.reshard_after_forward:
        options.append(("--reshard-after-forward true", {"reshard_after_forward": True}, False))
    if setup.cp > 1 and setup.strategy == "allgather":
        options.append(("--cp-comm-strategy alltoall (the ring rotation)", {"strategy": "alltoall"}, False))
    if "selective_blocks" in available and setup.activation_checkpointing and setup.checkpoint_level == "selective":
        options.append(("--checkpoint-level mixed", {"checkpoint_level": "mixed", "selective_blocks": None}, False))
    if "checkpoint_level" in available and setup.activation_checkpointing and setup.checkpoint_level != "full":
        options.append(("--checkpoint-level full (slower)", {"checkpoint_level": "full"}, True))
    if "tiled_mlp_tokens" in available and not setup.tiled_mlp_tokens:
        options.append(("--tiled-mlp-tokens 8192", {"tiled_mlp_tokens": 8192}, False))
    if "tiled_norm_tokens" in available and not setup.tiled_norm_tokens:
        options.append(("--tiled-norm-tokens 8192", {"tiled_norm_tokens": 8192}, False))
    if "offload_activations" in available and not setup.offload_activations:
        options.append(("--offload-activations true (slower)", {"offload_activations": True}, True))
    if "cpu_offload" in available and not setup.cpu_offload:
        options.append(("--cpu-offload true (slower)", {"cpu_offload": True}, True))
    return options


def _host_options(setup: Setup) -> list[tuple[str, dict[str, Any]]]:
    """The options that keep tensors in host memory, each turned down: (flag, Setup changes)."""
    options: list[tuple[str, dict[str, Any]]] = []
    if setup.offload_activations and setup.checkpoint_level != "full":
        options.append(("--checkpoint-level full (less host memory, slower)", {"checkpoint_level": "full"}))
    if setup.offload_activations:
        options.append(("--offload-activations false (the activations on the GPU)", {"offload_activations": False}))
    if setup.cpu_offload:
        options.append(("--cpu-offload false (parameters and optimizer on the GPU)", {"cpu_offload": False}))
    return options


def suggestions(base: Estimate, *, available: frozenset[str] = frozenset()) -> list[Suggestion]:
    """What to turn on: each option that lowers the need alone; those that cost little speed
    together; with the slow ones too if that is not enough; then the fewest GPUs, all on CP,
    with the current options and with the cheap ones."""
    model, setup, seq, memory, host = base.model, base.setup, base.seq_len, base.gpu_memory_gib, base.host_memory_gib

    def trying(changes: dict[str, Any]) -> Estimate:
        return estimate(model, dataclasses.replace(setup, **changes), seq, gpu_memory_gib=memory, host_memory_gib=host)

    found: list[Suggestion] = []
    if not base.fits_host:  # what keeps tensors in host memory, turned down
        for what, changes in _host_options(setup):
            found.append(Suggestion(what, changes, trying(changes)))
    cheap: dict[str, Any] = {}
    slow: dict[str, Any] = {}
    for what, changes, is_slow in _options_to_try(setup, available=available):
        alone = trying(changes)
        if changes.get("checkpoint_level") == "mixed":  # say the count it chose
            if not alone.setup.selective_blocks:
                continue  # none fit: that is the full level, offered below
            what += f" (selective for the last {alone.setup.selective_blocks} of {model.n_layers} blocks)"
        if alone.needed < base.needed - 0.05 * GiB:
            found.append(Suggestion(what, changes, alone))
            (slow if is_slow else cheap).update(changes)
    together = None
    if len(cheap) > 1:
        together = trying(cheap)
        found.append(Suggestion("together: " + ", ".join(option_names(cheap)), cheap, together))
    if slow and (cheap or len(slow) > 1) and not (together or trying(cheap)).fits:
        everything = {**cheap, **slow}
        found.append(Suggestion("together: " + ", ".join(option_names(everything)), everything, trying(everything)))
    for label, options in [("", {})] + ([(" + " + ", ".join(option_names(cheap)), cheap)] if cheap else []):
        wider = gpus_needed(model, dataclasses.replace(setup, **options), seq, gpu_memory_gib=memory,
                            host_memory_gib=host)
        if wider is not None and (wider.setup.gpus, wider.setup.cp) != (setup.gpus, setup.cp):
            gpus = wider.setup.gpus
            found.append(Suggestion(f"{gpus} GPU{'s' if gpus > 1 else ''}, all on CP (--cp-size {gpus}){label}",
                                    {**options, "gpus": gpus, "cp": gpus, "dp_shard": 1, "tp": 1}, wider))
    return found


def option_names(changes: Mapping[str, Any]) -> list[str]:
    names = {"activation_checkpointing": "checkpointing", "chunked_loss": "chunked loss",
             "reshard_after_forward": "resharding", "strategy": "ring rotation", "tiled_mlp_tokens": "tiled MLP",
             "tiled_norm_tokens": "tiled norms",
             "offload_activations": "activation offload", "cpu_offload": "CPU offload",
             "checkpoint_level": "mixed checkpointing"}
    return [names.get(name, name) for name in changes if name != "selective_blocks"]
