"""The data loader of `rt.prepare_dataloader`: batches split over dp ranks (repeated over cp and
tp ranks), a new shuffle every epoch, and a position a checkpoint can save and restore."""

from __future__ import annotations

import itertools

import torch

from cpctl.errors import CpctlError


class ResumableSampler(torch.utils.data.DistributedSampler):
    """A DistributedSampler that can start an epoch part-way, where a checkpoint left it."""

    start_index = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start_index, None)


class EpochDataLoader(torch.utils.data.DataLoader):
    """A DataLoader whose every pass is a new epoch (its sampler reshuffles), and which knows
    where it is, for checkpoints: `state_dict()` / `load_state_dict()`.

    The position is kept in samples of the whole dp batch, not in this rank's batches: a step
    consumes the same samples whatever the layout, so a checkpoint resumes at the right sample
    under another dp size.
    """

    _epoch = 0  # the epoch the next pass serves
    _current = 0  # the epoch being served
    _samples = 0  # samples of the whole dp batch served in it
    _resume_samples = 0  # where the next pass starts, after load_state_dict

    def __iter__(self):
        ranks, per_batch = self.sampler.num_replicas, self.batch_size or 1
        self._current, self._epoch = self._epoch, self._epoch + 1
        self.sampler.set_epoch(self._current)
        self.sampler.start_index = self._resume_samples // ranks
        self._samples, self._resume_samples = self._resume_samples, 0
        epoch_samples = len(self.sampler) * ranks  # the last batch may be short
        for batch in super().__iter__():
            self._samples = min(self._samples + per_batch * ranks, epoch_samples)
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._current, "samples": self._samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["samples"] % self.sampler.num_replicas:
            raise CpctlError(f"the checkpoint stopped at sample {state['samples']}, which {self.sampler.num_replicas} "
                             "dp ranks cannot split evenly; resume with a dp size that divides it")
        self._epoch, self._resume_samples = state["epoch"], state["samples"]
        self._current, self._samples = state["epoch"], state["samples"]  # a save before the next batch keeps it
