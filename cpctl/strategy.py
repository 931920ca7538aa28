"""The CP communication strategies by name: one enum for the profile, the wizard and the engine.

Torch-free, so the profile layer (`cpctl/config/`) can name the allowed values without
importing the engine.
"""

from __future__ import annotations

import enum

from cpctl.errors import CpctlError


class Strategy(str, enum.Enum):
    """How K/V move between CP ranks; the profile key `parallelism.cp_comm_strategy` names one."""

    ALLGATHER = "allgather"  # gather every rank's K/V once (allgather.py)
    # K/V blocks rotate around the ring of CP ranks (ring.py). PyTorch's and accelerate's name for it
    # is "alltoall", kept as the value so their profiles read the same; it is no all-to-all over
    # heads, which is Ulysses (parallelism.sp_size).
    RING = "alltoall"

    @property
    def what(self) -> str:
        """What the strategy does, in words (the value alone can be mistaken for Ulysses' all-to-all)."""
        if self is Strategy.RING:
            return "ring rotation: K/V blocks pass around the CP ranks, one neighbour to the next"
        return "all-gather: every CP rank gathers the whole sequence's K/V once"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str | Strategy) -> Strategy:
        """`value` as a Strategy; a plain string must be one of the names."""
        try:
            return cls(value)
        except ValueError:
            raise CpctlError(f"cp_comm_strategy {value!r}: choose one of {', '.join(s.value for s in cls)}") from None
