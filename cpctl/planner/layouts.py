"""Which way to split a sequence over its ranks: the ring (cp), Ulysses (sp) or both, and why.

The one place that decides it: `parallelism.sp_size: auto` at launch (config/rules.py calls
`choose_layout` with the profile's model and machines) and `cpctl plan`'s suggestion.

Ulysses trades a sequence shard for a head shard with one all-to-all each way per attention
call, then runs attention over the whole sequence for 1/sp of the heads: one kernel call, no
blocks to merge. Its local part is faster than a ring rank's, by less as each rank's share
grows: 1.7x at 2k tokens per rank, 4% at 16k, even at 32k (H200, bf16, 32/8 heads of 128, one
rank's share of an N-way split emulated on one GPU, docs/benchmarks.md: at N = 8, 2.8 ms against
the ring's 4.7 at 16k tokens, 114 against 119 at 128k; at N = 4, 229 against 227 at 128k). But
its all-to-all is not hidden behind compute, so it wants NVLink: it stays inside a node. The ring
moves K/V between neighbours and hides that behind compute while each rank has enough tokens,
so it takes what crosses nodes. Hence: Ulysses as wide as the node and the heads allow (sp
must divide the q heads of a tp rank), the ring over the rest.

The sequence length does not move the choice: both the all-to-all and the ring's K/V grow with
it alike; a split changes only what the length must be a multiple of (`topology.sequence_chunks`,
which the runtime pads to). What it decides is whether a step fits (`cpctl plan`'s tables).
"""

from __future__ import annotations

from dataclasses import dataclass

from cpctl.planner.shapes import ModelShape
from cpctl.topology import GPUS_PER_NODE, heads_split_problem, kv_copies


@dataclass(frozen=True)
class Layout:
    sp: int
    cp: int
    reason: str


def choose_layout(model: ModelShape, *, seq_ranks: int, ranks_per_node: int = GPUS_PER_NODE,
                  tp: int = 1) -> Layout:
    """The sp x cp split of the `seq_ranks` ranks that hold one sequence, for `model`, on machines
    of `ranks_per_node` ranks, with the reason in one sentence.

    Ranks are numbered as the mesh numbers them (tp fastest, then sp, then cp), so an sp group of
    a tp x sp block of consecutive ranks is inside one node when that block divides the node.
    """
    heads, kv_heads = max(1, model.n_heads // tp), max(1, model.n_kv_heads // tp)
    per_tp = " of its tp rank" if tp > 1 else ""
    if seq_ranks == 1:
        return Layout(1, 1, "one rank per sequence (cp_size 1): nothing to split")
    slots = ranks_per_node // tp if ranks_per_node % tp == 0 else 1  # sp positions inside one node
    fits = [d for d in range(1, min(slots, seq_ranks) + 1) if seq_ranks % d == 0 and slots % d == 0]
    sp = max(d for d in fits if heads_split_problem(heads, sp=d) is None)
    cp = seq_ranks // sp
    if sp == 1:
        return Layout(1, cp, f"the ring alone: no sp > 1 divides the {heads} attention heads{per_tp}, the {seq_ranks} "
                             f"ranks per sequence and the {slots} ranks per node that Ulysses can use")
    copies = kv_copies(q_heads=heads, kv_heads=kv_heads, sp=sp)
    replicated = (f"; its {kv_heads} K/V head{'s are' if kv_heads > 1 else ' is'} repeated {copies}x" if copies > 1
                  else "")
    ulysses = f"Ulysses sp {sp} within a node (each rank attends with {heads // sp} of the {heads} heads{per_tp}{replicated})"
    if cp == 1:
        return Layout(sp, 1, f"{ulysses}, no ring")
    wider = [d for d in fits if d > sp]  # allowed by the ranks and the node, so refused by the heads
    why_not_wider = f" (sp {wider[0]} would not divide the {heads} heads{per_tp})" if wider else ""
    where = "across nodes" if seq_ranks * tp > ranks_per_node else "within the node"
    return Layout(sp, cp, f"{ulysses}, the ring over cp {cp} {where}{why_not_wider}")
