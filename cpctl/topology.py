"""Facts of the parallel layout that both sides rely on, each written once, torch-free.

The launcher's side (`config/` resolving `sp_size: auto`, `planner/` counting memory) and the
workers' (`runtime/` padding and sharding sequences, `attention/` splitting heads) must agree on
these, or a plan says a layout fits that the workers then refuse or cut differently:

* how many equal chunks a sequence is cut into over its cp x sp ranks (`sequence_chunks`), which
  its length must be a multiple of (the runtime pads it to one);
* which Ulysses degrees a model's attention heads allow (`heads_split_problem`), and how many
  times each K/V head is repeated so that sp ranks can split them like the q heads (`kv_copies`);
* the machine assumed where none is known (`GPUS_PER_NODE`).
"""

from __future__ import annotations

import math

from cpctl.errors import CpctlError

# GPUs of one machine where nothing says otherwise: an HGX/DGX node of 8 (H100, H200). Ulysses'
# all-to-all stays inside one (over NVLink); a cuda profile checked away from its GPUs, and a plan
# of more than 8 GPUs, assume nodes of this many.
GPUS_PER_NODE = 8


def head_tail(*, cp: int, load_balance: bool) -> bool:
    """Whether the ring cuts a sequence into head-tail chunks (2 per rank): with cp_load_balance and
    another rank to balance against; at cp 1 the one rank holds the sequence as one chunk."""
    return load_balance and cp > 1


def sequence_chunks(*, cp: int, sp: int = 1, load_balance: bool = True) -> int:
    """How many equal chunks a sequence is cut into over its cp x sp ranks: what its length must
    be a multiple of. The ring cuts it into 2 x cp chunks with cp_load_balance (head-tail: rank r
    holds chunks r and 2cp-1-r, so causal work is even), cp without, and one at cp 1 (no other
    rank to balance against); Ulysses then cuts each ring chunk over its sp ranks."""
    ring = 2 * cp if head_tail(cp=cp, load_balance=load_balance) else cp
    return ring * sp


def heads_split_problem(q_heads: int, *, sp: int, tp: int = 1) -> str | None:
    """Why Ulysses cannot split these heads over `sp` ranks (each tp rank's q heads must divide
    evenly), else None. K/V heads need not divide: fewer than sp are repeated (`kv_copies`)."""
    per_rank = q_heads // tp
    if sp > 1 and per_rank % sp:
        heads = f"{per_rank} per tp rank" if tp > 1 else f"{per_rank}"
        largest = max(d for d in range(1, sp + 1) if per_rank % d == 0)  # the widest split below the one asked
        example = f" (e.g. {largest})" if largest > 1 else ""
        return (f"sp_size {sp} splits attention heads, but it has {heads} attention heads; choose an sp_size "
                f"that divides {per_rank}{example}")
    return None


def kv_copies(*, q_heads: int, kv_heads: int, sp: int) -> int:
    """How many times each K/V head is repeated so that `sp` ranks can split them like the q heads:
    1 when sp divides the K/V heads, else up to their least common multiple with sp."""
    problem = heads_split_problem(q_heads, sp=sp)
    if problem is not None:
        raise CpctlError(problem)
    if q_heads % kv_heads:
        raise CpctlError(f"GQA needs q heads ({q_heads}) to be a multiple of k/v heads ({kv_heads})")
    return math.lcm(kv_heads, sp) // kv_heads
