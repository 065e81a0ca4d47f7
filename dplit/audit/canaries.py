"""The audit's canaries: gradient directions (white box) or random-token examples (black box), each in with p = 1/2."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from dplit.data.batches import TokenizedDataset
from dplit.data.text import TextDataset, TextExample
from dplit.privacy.clipping.engine import Batch


def _membership(count: int, generator: torch.Generator) -> Tensor:
    """Which of ``count`` canaries take part in the run: each independently with probability 1/2 [count] (bool)."""
    return torch.rand(count, generator=generator, dtype=torch.float64) < 0.5


def white_box_step_score(observed: Tensor, *, noise_multiplier: float, sample_rate: float) -> Tensor:
    """One step's log-likelihood ratio "in" : "out" of each canary, from its released coordinate in units of C.

    An included canary adds 1 with probability q, and the noise adds N(0, σ²): the step's likelihood ratio is
    1 − q + q·exp((2x − 1) / (2σ²)). Steps are independent given membership, so the sum of these logs over the steps
    is the Neyman-Pearson optimal statistic for a Dirac canary (for q = 1 it is affine in Σx, the running sum the
    (ε, δ) audit used). Without noise any ordering of the count of inclusions is optimal: the score is x (the
    simulated runs' score; on a real model's readings :class:`GradientCanaries` uses :func:`noiseless_scores`).

    Args:
        observed: the released noisy sum at each canary's coordinate, divided by the step's C [m] (float64).
        noise_multiplier: σ of the step (0: no noise).
        sample_rate: q, the chance an included canary is in the step's batch.
    """
    if noise_multiplier <= 0:
        return observed
    shift = (2 * observed - 1) / (2 * noise_multiplier**2)  # [m]
    return shift if sample_rate >= 1 else _sampled_log_ratio(shift, sample_rate)


def _sampled_log_ratio(shift: Tensor, sample_rate: float) -> Tensor:
    """log(1 − q + q·exp(shift)): a step's log-likelihood ratio when the canary is in the batch with probability q."""
    return torch.logaddexp(torch.full_like(shift, math.log1p(-sample_rate)), shift + math.log(sample_rate))


NOISELESS_SCALE_FLOOR = 1e-3
"""The least spread (in units of C) a canary's readings are scored at without noise: a coordinate the data never
touch has none, and its inclusions then simply dominate the ranking."""


def noiseless_scores(readings: Tensor, *, sample_rate: float) -> Tensor:
    """Each canary's score from all its readings of a run without noise in sampled batches [m].

    Without noise the only thing besides the canary at its coordinate is the real examples' gradients there. They
    act as noise of the coordinate's own level and spread. Both are read from the canary's readings without their
    ⌈2qT + 2⌉ largest (where its inclusions, about qT, lie): the median of the rest, and 1.4826 × their median
    absolute deviation (at least :data:`NOISELESS_SCALE_FLOOR`); every step is then scored by the likelihood ratio of
    :func:`white_box_step_score` at that spread. On drift-free readings of a canary included at most that many times
    this orders canaries by their number of inclusions, as the plan's simulated sum does; on a real model a canary
    whose coordinate the data move by about one C no longer outranks one sampled once. With fewer than 3 readings
    left (short runs, large q) level and spread cannot be told from the canary's own: the plain sum is the score.

    Args:
        readings: every step's reading of every canary, in units of C [T, m].
        sample_rate: q (below 1: in full batches every included canary rises at every step, so the plain sum is used).
    """
    steps = readings.shape[0]
    kept = steps - math.ceil(2 * sample_rate * steps + 2)
    if kept < 3:
        return readings.sum(dim=0)
    rest = readings.sort(dim=0).values[:kept]  # [kept, m]: each canary's smallest readings
    level = rest.median(dim=0).values  # [m]
    scale = (1.4826 * (rest - level).abs().median(dim=0).values).clamp(min=NOISELESS_SCALE_FLOOR)  # [m]
    rise = readings - level  # [T, m]
    shift = (2 * rise - 1) / (2 * scale**2)  # [T, m]: as white_box_step_score's, at the coordinate's own spread
    return _sampled_log_ratio(shift, sample_rate).sum(dim=0)  # [T, m] -> [m]


class GradientCanaries:
    """White-box canaries: m Dirac directions of norm C in the trainable parameters, one coordinate each.

    An included canary takes part in DP-SGD exactly as one more example whose clipped gradient is that direction:
    Poisson-sampled at rate q every step and added to the clipped sum before the noise. The auditor reads the
    released noisy sum at every canary's coordinate on every step (all iterates), in units of C: the score is the
    sum of the steps' log-likelihood ratios (:func:`white_box_step_score`; without noise in sampled batches,
    :func:`noiseless_scores` of all the readings at the end); the first step's readings, the sums of
    the readings and of their squares, and each canary's sampled-vs-earlier contrast feed the audit's checks of the
    mechanism's scale (:mod:`dplit.audit.calibration`).

    Args:
        coordinates: the flat gradient index of each canary [m] (distinct).
        included: whether each canary takes part in the run [m] (bool).
        norm: the norm of each canary's gradient (the clipping bound C).
    """

    def __init__(self, *, coordinates: Tensor, included: Tensor, norm: float) -> None:
        self.coordinates = coordinates
        self.included = included
        self.norm = norm
        self._step_scores = torch.zeros(coordinates.shape[0], dtype=torch.float64)
        self.reading_sums = torch.zeros(coordinates.shape[0], dtype=torch.float64)
        self.reading_squares = torch.zeros(coordinates.shape[0], dtype=torch.float64)
        self.first_readings: Tensor | None = None
        self.contrast_sums = torch.zeros(coordinates.shape[0], dtype=torch.float64)
        self.contrast_squares = torch.zeros(coordinates.shape[0], dtype=torch.float64)
        self.contrast_steps = 0
        self.steps = 0
        self._noiseless_readings: list[Tensor] = []
        """Every step's readings [m] of a run without noise in sampled batches, scored once at the end."""
        self._sample_rate = 1.0
        self.sampled_last_step = 0
        self._drawn: Tensor | None = None

    @classmethod
    def place(cls, count: int, *, size: int, norm: float, generator: torch.Generator) -> GradientCanaries:
        """``count`` canaries on distinct coordinates drawn uniformly among ``size``, membership drawn by ``generator``."""
        if count > size:
            raise ValueError(f"audit.canaries={count} exceeds the {size} trainable coordinates of the model")
        coordinates = torch.randperm(size, generator=generator)[:count]
        return cls(coordinates=coordinates, included=_membership(count, generator), norm=norm)

    def add_sampled(
        self, gradient_sum: Tensor, *, sample_rate: float, generator: torch.Generator, norm: float | None = None
    ) -> int:
        """Add a canary's norm at the coordinate of every included canary this step's Poisson draw samples.

        The norm is this step's ``norm`` (C_t under quantile clipping), else C. Returns how many were sampled.
        """
        drawn = torch.rand(self.included.shape[0], generator=generator, dtype=torch.float64) < sample_rate  # [m]
        self._drawn = drawn & self.included
        sampled = self.coordinates[self._drawn]
        gradient_sum[sampled.to(gradient_sum.device)] += self.norm if norm is None else norm
        self.sampled_last_step = int(sampled.numel())
        return self.sampled_last_step

    @property
    def scores(self) -> Tensor:
        """Each canary's score [m]: the sum of its steps' likelihood ratios, or :func:`noiseless_scores` without noise."""
        if self._noiseless_readings:
            return noiseless_scores(torch.stack(self._noiseless_readings), sample_rate=self._sample_rate)  # [T, m] in
        return self._step_scores

    def observe(self, released: Tensor, *, clip_bound: float, noise_multiplier: float, sample_rate: float) -> None:
        """Read the released noisy sum at each canary's coordinate, in units of the step's C, and score it.

        Where this step's draws are known (rank 0, which added the canaries), each canary also adds
        (s − q)·(x − mean of its earlier readings) to its contrast: s, whether it was sampled, is independent of
        everything else in the step, so the sum has mean q(1 − q) per step and included canary whatever the model did
        before (:func:`dplit.audit.calibration.sampled_contrast_signal`).

        Args:
            released: the step's noisy sum over every trainable coordinate (flat).
            clip_bound: the step's C (each canary's contribution when sampled).
            noise_multiplier: the step's σ (the noise's std in units of C).
            sample_rate: q.
        """
        reading = released[self.coordinates.to(released.device)].double().cpu() / clip_bound  # [m]
        if noise_multiplier <= 0 and sample_rate < 1:
            self._noiseless_readings.append(reading)
            self._sample_rate = sample_rate
        else:
            self._step_scores += white_box_step_score(reading, noise_multiplier=noise_multiplier, sample_rate=sample_rate)
        if self._drawn is not None:  # where the canaries were added (rank 0): which readings carry one
            earlier = self.reading_sums / self.steps if self.steps else torch.zeros_like(reading)  # [m]
            term = (self._drawn.double() - sample_rate) * (reading - earlier)  # [m]
            self.contrast_sums += term
            self.contrast_squares += term**2
            self.contrast_steps += 1
            self._drawn = None
        self.reading_sums += reading
        self.reading_squares += reading**2
        if self.first_readings is None:
            self.first_readings = reading
        self.steps += 1


class InputCanaries:
    """Black-box canaries: random-token examples added to the training data, scored by minus their final loss.

    Args:
        rows: one training example per canary, as the datamodule's own dataset class holds them.
        included: whether each canary is added to the training data [m] (bool).
    """

    def __init__(self, rows: Dataset[Any], included: Tensor) -> None:
        self._rows = rows
        self.included = included

    @classmethod
    def for_classifier(
        cls, count: int, *, vocab_size: int, num_classes: int, length: int, generator: torch.Generator
    ) -> InputCanaries:
        """``count`` random-token prompts of ``length`` tokens, each with a random class."""
        tokens = torch.randint(0, vocab_size, (count, length), generator=generator)  # [m, length]
        labels = torch.randint(0, num_classes, (count,), generator=generator)  # [m]
        return cls(TokenizedDataset(tokens.tolist(), labels.tolist()), _membership(count, generator))

    @classmethod
    def for_language_model(
        cls, count: int, *, vocab_size: int, length: int, generator: torch.Generator
    ) -> InputCanaries:
        """``count`` random-token sequences of ``length`` tokens, every token trained."""
        tokens = torch.randint(0, vocab_size, (count, length), generator=generator)  # [m, length]
        examples = [TextExample(input_ids=row, loss_mask=[1] * length) for row in tokens.tolist()]
        return cls(TextDataset(examples), _membership(count, generator))

    def training_set(self) -> Dataset[Any]:
        """The included canaries, to be added to the training data."""
        return Subset(self._rows, self.included.nonzero().flatten().tolist())

    @torch.no_grad()
    def scores(
        self, per_example_loss: Callable[[Batch], Tensor], collate: Callable[[list[Any]], Batch], *,
        batch_size: int, device: torch.device,
    ) -> Tensor:  # fmt: skip
        """Minus each canary's loss under the final model [m] (float64)."""
        loader = DataLoader(self._rows, batch_size=batch_size, collate_fn=collate)
        losses = []
        for batch in loader:
            losses.append(per_example_loss({key: value.to(device) for key, value in batch.items()}).double().cpu())
        return -torch.cat(losses)
