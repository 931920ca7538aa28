"""Which way to split a sequence over GPUs: the ring (cp), Ulysses (sp) or both, and why.

Ulysses trades a sequence shard for a head shard with one all-to-all each way per attention
call; its volume per GPU does not grow with the sequence's share of other GPUs, but it needs
heads to split and a fast all-to-all, so it stays inside a node (NVLink). The ring moves K/V
between neighbours and hides it behind compute only while each rank has enough tokens (the
measured scaling on 2 H200: 67% at 32k, 91% at 128k, 98% at 256k). So: Ulysses as wide as the
node and the heads allow, the ring across nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cpctl.planner.shapes import ModelShape

GPUS_PER_NODE = 8  # an all-to-all wider than a node leaves NVLink


@dataclass(frozen=True)
class Layout:
    sp: int
    cp: int
    reason: str


def choose_layout(model: ModelShape, *, gpus: int, tp: int = 1, gpus_per_node: int = GPUS_PER_NODE) -> Layout:
    """The sp x cp split of `gpus` sequence ranks for `model`, with the reason in one sentence."""
    heads, kv_heads = model.n_heads // tp, max(1, model.n_kv_heads // tp)
    node = max(1, min(gpus_per_node, gpus))
    sp = max(d for d in range(1, node + 1) if gpus % d == 0 and heads % d == 0 and node % d == 0)
    cp = gpus // sp
    if sp == 1:
        why = (f"ring only: no sp > 1 divides both {heads} heads and {node} GPUs per node" if gpus > 1
               else "one GPU: nothing to split")
        return Layout(1, cp, why)
    replicated = f"; {kv_heads} K/V heads are repeated {math.lcm(kv_heads, sp) // kv_heads}x" if kv_heads < sp else ""
    ring = f"the ring over cp {cp} across nodes" if cp > 1 else "no ring"
    return Layout(sp, cp, f"Ulysses sp {sp} inside the node ({heads // sp} of {heads} heads per GPU{replicated}), {ring}")
