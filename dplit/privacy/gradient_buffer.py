"""One contiguous buffer for the summed clipped gradients: no copies to flatten, noise in place, one all-reduce."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

NOISE_CHUNK = 1 << 20
"""Noise entries drawn at a time by :meth:`GradientBuffer.add_noise` (4 MiB of float32: within a CPU's cache)."""


class GradientBuffer:
    """The clipped-gradient sum of every trainable parameter in one flat tensor, plus ``extra`` scalar slots.

    While attached, each parameter's ``grad`` is a view into the buffer, so a clipping engine's in-place
    accumulation lands in it directly. The buffer is kept in float32 (float64 for float64 parameters); a
    parameter of another dtype (e.g. bf16 weights) is accumulated in its own ``grad`` and folded in by
    :meth:`detach`.

    Args:
        parameters: the trainable parameters, in a fixed order.
        extra: scalar slots after the gradients (e.g. a flag that travels in the same all-reduce).
    """

    def __init__(self, parameters: list[nn.Parameter], *, extra: int = 0) -> None:
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in parameters) else torch.float32
        device = parameters[0].device if parameters else torch.device("cpu")
        self._parameters = parameters
        self._index = {id(p): index for index, p in enumerate(parameters)}
        shapes = [self.held_shape(p) for p in parameters]
        sizes = [shape.numel() for shape in shapes]
        self._total = sum(sizes)
        self.flat = torch.zeros(self._total + extra, dtype=dtype, device=device)
        chunks = self.flat[: self._total].split(sizes)
        self._views = [chunk.view(shape) for chunk, shape in zip(chunks, shapes, strict=True)]

    @staticmethod
    def held_shape(param: nn.Parameter) -> torch.Size:
        """The shape of the part of ``param``'s gradient this buffer holds: all of it (a ``DTensor``'s global shape)."""
        return param.shape

    @property
    def extra(self) -> Tensor:
        """The scalar slots after the gradients."""
        return self.flat[self._total :]

    @property
    def gradients(self) -> Tensor:
        """The gradient entries (every parameter's, flat, in order), without the extra slots."""
        return self.flat[: self._total]

    @contextmanager
    def receiving(self) -> Iterator[GradientBuffer]:
        """Zero the buffer; inside, every ``param.grad`` is a view into it, so gradients summed there land here.

        On exit, gradients held outside the buffer (parameters of another dtype) are folded in and every ``grad``
        is ``None`` again: nothing of the clipped sum is left where an optimizer could step on it unnoised.
        """
        self.attach()
        try:
            yield self
        finally:
            self.detach()

    def attach(self) -> None:
        """Zero the buffer and make every matching-dtype parameter's ``grad`` a view into it."""
        self.flat.zero_()
        for param, view in zip(self._parameters, self._views, strict=True):
            param.grad = view if param.dtype == view.dtype else None

    def receive(self, param: nn.Parameter) -> None:
        """Take a micro-batch's completed sum of ``param`` (a clipping engine's summed hook).

        A sum already in the buffer (``grad`` is a view into it) stays; one held outside (another dtype) is
        added in float32/64 at once, so micro-batches never accumulate in bf16.
        """
        index = self._index[id(param)]
        view = self._views[index]
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.add_(param.grad.to(view.dtype))
            param.grad = None

    def detach(self) -> None:
        """Fold gradients held outside the buffer into it; leave every ``grad`` ``None``."""
        for param, view in zip(self._parameters, self._views, strict=True):
            if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                view.add_(param.grad.to(view.dtype))
            param.grad = None

    def add_noise(self, std: float, generator: torch.Generator) -> None:
        """Add N(0, std²) to every gradient entry, :data:`NOISE_CHUNK` entries at a time (no buffer-sized temporary).

        One scratch of the chunk's size is drawn into and added again and again: on a CPU it stays in the cache
        between the draw and the add, and no parameter-sized allocation is made (or page-faulted) each step.
        """
        gradients = self.gradients
        scratch = torch.empty(min(NOISE_CHUNK, gradients.numel()), dtype=gradients.dtype, device=gradients.device)
        for start in range(0, gradients.numel(), NOISE_CHUNK):
            piece = gradients[start : start + NOISE_CHUNK]
            piece.add_(scratch[: piece.numel()].normal_(0.0, std, generator=generator))

    def publish(self, scale: float) -> None:
        """Divide the gradients by ``scale`` and hand them to the parameters as their ``grad``."""
        for param, view in zip(self._parameters, self._views, strict=True):
            view.div_(scale)
            param.grad = view if param.dtype == view.dtype else view.to(param.dtype)

    def refuse_non_finite(self, *, step: int) -> None:
        """Raise ``FloatingPointError`` if any entry (noise included) is NaN or infinite, before anything is released."""
        smallest, largest = torch.aminmax(self.flat)  # one pass; NaN and ±inf propagate into these
        if not bool(torch.isfinite(smallest) & torch.isfinite(largest)):
            raise FloatingPointError(
                f"DP-SGD step {step}: the noisy gradient sum is not finite (NaN or inf; check trainer.precision and "
                "the learning rate); stopped before the optimizer step, nothing of it was released"
            )
