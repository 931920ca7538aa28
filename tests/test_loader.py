"""The data loader's position, as checkpoints save and restore it (no processes needed)."""

from __future__ import annotations

import torch

from cpctl.runtime.loader import EpochDataLoader, ResumableSampler
from cpctl.runtime.context import same_documents


def loader(ranks: int = 1, rank: int = 0, batch: int = 3, n: int = 10) -> EpochDataLoader:
    data = torch.utils.data.TensorDataset(torch.arange(n))
    sampler = ResumableSampler(data, num_replicas=ranks, rank=rank, shuffle=False, drop_last=False)
    return EpochDataLoader(data, batch_size=batch, sampler=sampler)


def test_a_resumed_loader_continues_at_the_next_sample_and_reports_it_at_once() -> None:
    first = loader()
    it = iter(first)
    next(it)
    state = first.state_dict()
    assert state == {"epoch": 0, "samples": 3}
    second = loader()
    second.load_state_dict(state)
    assert second.state_dict() == state  # a checkpoint saved before the next batch keeps the position
    assert next(iter(second))[0].tolist() == [3, 4, 5]


def test_a_short_last_batch_counts_only_its_samples() -> None:
    full = loader(batch=3, n=10)
    for _ in full:
        pass
    assert full.state_dict() == {"epoch": 0, "samples": 10}


def test_the_position_is_in_samples_of_the_whole_dp_batch() -> None:
    # two dp ranks with batches of 2 consume samples 0..3 per step; one rank resumes at sample 4
    ranks = [loader(ranks=2, rank=r, batch=2, n=12) for r in range(2)]
    for dp_loader in ranks:
        next(iter(dp_loader))
    assert ranks[0].state_dict() == {"epoch": 0, "samples": 4}
    alone = loader(ranks=1, batch=4, n=12)
    alone.load_state_dict(ranks[0].state_dict())
    assert next(iter(alone))[0].tolist() == [4, 5, 6, 7]


def test_one_row_of_documents_stands_for_every_row() -> None:
    assert same_documents([(0, 5)], [(0, 5), (0, 5)])
    assert same_documents([(0, 5), (0, 5)], [(0, 5)])
    assert not same_documents([(0, 5)], [(0, 5), (0, 6)])
