"""The runtime as the Hugging Face integration sees it: exactly the members it uses.

The integration is handed the runtime's step context (`cpctl.runtime.context.StepContext`,
through its adapter: runtime/adapters.py), never the user's `Runtime`. It names that object's
type through this Protocol, so that a test can hand it a stand-in of one process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from cpctl.config import Profile
    from cpctl.runtime.mesh import ParallelMesh
    from cpctl.runtime.padding import EndPadding
    from cpctl.runtime.step import HiddenKeys


class RuntimeView(Protocol):
    """What huggingface.py and hf_padding.py call on the step context handed to them."""

    config: Profile
    mesh: ParallelMesh
    caller_counts_tokens: bool  # inside caller_counts_loss_tokens()
    attention_calls: int  # calls of the CP engine so far

    @property
    def sp_size(self) -> int: ...

    @property
    def seq_size(self) -> int: ...

    @property
    def cp_active(self) -> bool: ...

    @property
    def padding(self) -> EndPadding | None: ...

    def shard(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor: ...

    def gather_padded(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor: ...

    def appended_in_shard(self, local_len: int, *, device: torch.device | None = None) -> torch.Tensor | None: ...

    def hide_keys(self, rows: HiddenKeys) -> None: ...

    def require_sharded(self, tensor: torch.Tensor | None, *, name: str, seq_dim: int) -> None: ...

    def adopt_position_ids(self, position_ids: torch.Tensor) -> bool: ...

    def every_seq_rank(self, holds: bool) -> bool: ...

    def step_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor: ...

    def shift_sharded(self, labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor: ...
