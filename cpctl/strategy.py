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
    ALLTOALL = "alltoall"  # pass K/V blocks around a ring (ring.py)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str | Strategy) -> Strategy:
        """`value` as a Strategy; a plain string must be one of the names."""
        try:
            return cls(value)
        except ValueError:
            raise CpctlError(f"cp_comm_strategy {value!r}: choose one of {', '.join(s.value for s in cls)}") from None
