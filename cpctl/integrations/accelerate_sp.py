"""accelerate's `sp_size` on cpctl's Ulysses: an accelerate script whose ParallelismConfig asks for
sequence parallelism (which accelerate 1.15 hands to DeepSpeed) runs on cpctl's engine, on FSDP2.

accelerate builds no mesh for sp (DeepSpeed makes its own groups) and refuses cp and sp
together. But an sp rank is, for everything outside attention, what a cp rank is: it holds
other tokens of the same batch, so FSDP shards over it, the data loader gives it the same
batch and the loss is averaged over it. So accelerate is shown cp x sp ranks as its own cp axis
(consecutive ranks, in the order of cpctl's mesh: accelerate flattens them exactly as cpctl
does), and behind `maybe_context_parallel` cpctl's runtime splits them into Ulysses and the
ring. The sizes the script asked for are noted for the config in the patch registry
(`requested`), for the check against the profile.

Installed by cpctl.integrations.accelerate_shim (which gates accelerate's release first), on
cpctl's engine only; the shim installs `sp_shown_as_cp` in cpctl's patch registry (undone with the rest).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from cpctl.integrations.patches import PATCHES
from cpctl.upstream import Shape

REQUESTED = "requested sizes"  # the cp and sp sizes the script's config asked for, noted in the registry
# accelerate's __post_init__ reads the sizes this one sets before it (and validates them)
POST_INIT_SHAPE = Shape(reads=("cp_size", "sp_size"))


def sp_shown_as_cp(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """ParallelismConfig.__post_init__ that presents sp x cp as cp (sp 1), keeping what was asked."""

    @functools.wraps(original)
    def post_init(self: Any) -> None:
        cp, sp = _size(self.cp_size, "CP_SIZE"), _size(self.sp_size, "SP_SIZE")
        if isinstance(sp, int) and sp > 1 and isinstance(cp, int) and cp >= 1:
            self.cp_size, self.sp_size = cp * sp, 1
        original(self)
        PATCHES.note(self, REQUESTED, {"cp_size": cp, "sp_size": sp})

    return post_init


def requested(parallelism_config: Any) -> dict[str, Any]:
    """The cp and sp sizes a config was asked for, before cpctl showed them to accelerate as cp."""
    return dict(PATCHES.noted(parallelism_config, REQUESTED, {}))


def _size(value: Any, name: str) -> Any:
    """A size as accelerate reads it: the argument, else its PARALLELISM_CONFIG_ variable, else 1."""
    return int(os.environ.get(f"PARALLELISM_CONFIG_{name}", "1")) if value is None else value
