"""CausalLanguageModel: DP-SGD fine-tuning for text generation (next-token prediction on a user's corpus)."""

from __future__ import annotations

import math
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from dplit.backbone.isolation import POSITION_KEY, SEGMENT_KEY, isolation_refusal, model_mask
from dplit.privacy.diagnostics import private_diagnostics_allowed
from dplit.tasks.base import Batch, CausalLMModule, positions_of

DEFAULT_SAMPLE_PROMPTS = ("the movie", "this film is")


@runtime_checkable
class PackedRowsReport(Protocol):
    """A collate function that packs documents into rows and says how full they were (``data.packing=true``)."""

    def summary(self) -> str:
        """One line: how many rows were packed and how full they were (from the private data, without noise)."""
        ...


class CausalLanguageModel(CausalLMModule):
    """Next-token prediction over whole examples, one example per row (no packing: the privacy unit is a row).

    A batch holds ``input_ids``, ``attention_mask`` and ``loss_mask`` [B, T]; ``loss_mask`` marks the tokens
    whose prediction is trained (every real token after the first, or only the response of a prompt/response
    pair). Example i's loss is the sum (or mean) of its token losses: with ``"sum"`` the clipping bound C caps
    the whole example's gradient however long it is; with ``"mean"`` long and short examples weigh the same.

    Args:
        loss_reduction: per-example ``"sum"`` or ``"mean"`` of the token losses (changes what C means).
        sample_prompts: prompts whose greedy continuations are logged as text every validation (``None``: two
            movie-review prompts; ``[]``: no samples). Each must be a non-empty string whose tokens, with
            ``sample_tokens`` more, fit the backbone's position limit (checked once the tokenizer is known).
        sample_tokens: tokens generated per sample (≥ 1).
        **kwargs: the backbone, embedding, adapter, freezing and optimizer arguments of
            :class:`~dplit.tasks.base.CausalLMModule` (``pretrained``, ``config``, ``lr``, ...).
    """

    SHARDED_ENTRY_POINTS = ("generate_text", "packed_logits")

    def __init__(
        self,
        *,
        loss_reduction: Literal["sum", "mean"] = "sum",
        sample_prompts: list[str] | None = None,
        sample_tokens: int = 16,
        **kwargs: Any,
    ) -> None:
        if loss_reduction not in ("sum", "mean"):
            raise ValueError(f"model.loss_reduction must be 'sum' or 'mean', got {loss_reduction!r}")
        _check_samples(sample_prompts, sample_tokens)
        super().__init__(**kwargs)
        self.apply_freeze()
        self._sample_prompts = list(DEFAULT_SAMPLE_PROMPTS if sample_prompts is None else sample_prompts)
        self._val_loss_sum = 0.0
        self._val_tokens = 0

    @override
    def setup(self, stage: str) -> None:
        """Refuse, before any step, a sample prompt the data's tokenizer encodes too short or too long."""
        tokenizer = getattr(self.trainer.datamodule, "tokenizer", None) if self.trainer.datamodule else None
        if tokenizer is not None:
            _check_prompt_lengths(self._sample_prompts, tokenizer, self.hparams.sample_tokens, self.max_positions)
        packing = getattr(self.trainer.datamodule, "hparams", {}).get("packing") if self.trainer.datamodule else False
        refusal = isolation_refusal(self.backbone) if packing else None
        if refusal is not None:
            raise ValueError(refusal)

    @override
    def on_train_end(self) -> None:
        """Say how full a packed run's rows were (``data.packing=true``): a private diagnostic, as ``train/loss`` is."""
        collate = getattr(self.trainer.train_dataloader, "collate_fn", None)
        if isinstance(collate, PackedRowsReport) and private_diagnostics_allowed(self.trainer.strategy):
            rank_zero_info(collate.summary())

    @override
    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Next-token logits [B, T, V] (the one way to the backbone: a sharded model gathers its weights here)."""
        positions = positions_of(attention_mask)  # [B, T]
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits

    def packed_logits(self, input_ids: Tensor, segment_ids: Tensor, position_ids: Tensor) -> Tensor:
        """Next-token logits [B, T, V] of packed rows: each document attends to itself only, positions restarting."""
        mask = model_mask(self.backbone, segment_ids)  # [B, 1, T, T] block-diagonal causal
        return self.backbone(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).logits

    def token_losses(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """Cross-entropy of each predicted token [B, T-1] and the mask of trained predictions [B, T-1].

        A packed batch (``segment_ids``) trains no prediction across a document boundary.
        """
        ids, mask = batch["input_ids"], batch["attention_mask"]
        segments = batch.get(SEGMENT_KEY)
        logits = self(ids, mask) if segments is None else self.packed_logits(ids, segments, batch[POSITION_KEY])
        predicted = logits[:, :-1]  # [B, T-1, V]: position t predicts token t + 1
        predicted = predicted if predicted.dtype == torch.float64 else predicted.float()  # 16-bit: in float32
        losses = F.cross_entropy(predicted.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T-1]
        trained = batch["loss_mask"][:, 1:] * mask[:, 1:] * mask[:, :-1]  # [B, T-1]
        if segments is not None:
            trained = trained * (segments[:, 1:] == segments[:, :-1])  # within one document
        trained = trained.to(losses.dtype)
        return losses * trained, trained

    @override
    def per_example_loss(self, batch: Batch) -> Tensor:
        """Each example's summed (or mean) token loss [B]; example i's loss depends on example i only.

        A packed batch gives per-token losses [B, T] instead (each document's own sum or mean, spread over its
        tokens): the ghost engine sums them per document (or user).
        """
        losses, trained = self.token_losses(batch)
        if SEGMENT_KEY in batch:
            return _packed_token_losses(losses, trained, batch[SEGMENT_KEY], mean=self.hparams.loss_reduction == "mean")
        total = losses.sum(1)  # [B]
        return total if self.hparams.loss_reduction == "sum" else total / trained.sum(1).clamp(min=1)

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        """Non-private step (DPStrategy replaces it with clipped, noisy micro-batches)."""
        losses = self.per_example_loss(batch)
        documents = int(batch[SEGMENT_KEY].max()) + 1 if SEGMENT_KEY in batch else losses.shape[0]
        loss = losses.sum() / max(documents, 1)
        self.log("train/loss", loss, batch_size=batch["input_ids"].shape[0])
        return loss

    @override
    def on_validation_epoch_start(self) -> None:
        """Reset the validation token-loss totals."""
        self._val_loss_sum, self._val_tokens = 0.0, 0

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        """Accumulate the token losses of the validation set."""
        losses, trained = self.token_losses(batch)
        self._val_loss_sum += float(losses.sum())
        self._val_tokens += int(trained.sum())

    @override
    def on_validation_epoch_end(self) -> None:
        """Log ``val/loss`` (mean per token), ``val/perplexity`` and greedy samples from the fixed prompts."""
        totals = torch.tensor([self._val_loss_sum, float(self._val_tokens)], device=self.device, dtype=torch.float64)
        totals = self.trainer.strategy.reduce(totals, reduce_op="sum") if self.trainer.world_size > 1 else totals
        loss = float(totals[0] / totals[1].clamp(min=1))
        # already summed over ranks: every rank logs the same value, so their mean (sync_dist) is that value
        self.log("val/loss", loss, batch_size=1, sync_dist=True)
        self.log("val/perplexity", math.exp(min(loss, 50.0)), prog_bar=True, batch_size=1, sync_dist=True)
        self._log_samples()

    def generate_text(self, prompts: list[str], tokenizer: Any, max_new_tokens: int) -> list[str]:
        """Greedy continuations of ``prompts`` (with the KV cache), decoded without the prompt."""
        samples = []
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt)], device=self.device)  # [1, T]
            out = self.backbone.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=tokenizer.pad_token_id,
            )  # [1, T + new]
            samples.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        return samples

    def _log_samples(self) -> None:
        tokenizer = getattr(self.trainer.datamodule, "tokenizer", None) if self.trainer.datamodule else None
        if tokenizer is None or not self._sample_prompts or self.trainer.sanity_checking:
            return
        samples = self.generate_text(self._sample_prompts, tokenizer, self.hparams.sample_tokens)
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger) and self.trainer.is_global_zero:
                text = "\n\n".join(f"**{p}** → {s}" for p, s in zip(self._sample_prompts, samples, strict=True))
                logger.experiment.add_text("samples/greedy", text, global_step=self.global_step)


def _packed_token_losses(losses: Tensor, trained: Tensor, segments: Tensor, *, mean: bool) -> Tensor:
    """Per-token losses [B, T] of packed rows: summed per document they give its sum (or, ``mean``, its mean).

    ``losses`` and ``trained`` are per prediction [B, T-1] (position t predicts t + 1, in t's document).
    """
    if mean:  # each document's trained predictions, over all its rows
        documents = segments[:, :-1].clamp(min=0)  # [B, T-1]: padding (-1) predicts nothing
        counts = trained.new_zeros(int(segments.max()) + 1 if segments.numel() else 1)
        counts.index_add_(0, documents.reshape(-1), trained.reshape(-1))
        losses = losses / counts[documents].clamp(min=1)
    return F.pad(losses, (0, 1))  # [B, T]: the last position predicts nothing


def _check_samples(sample_prompts: list[str] | None, sample_tokens: int) -> None:
    if isinstance(sample_tokens, bool) or not isinstance(sample_tokens, int) or sample_tokens < 1:
        raise ValueError(f"model.sample_tokens={sample_tokens!r}: must be an integer ≥ 1 (tokens generated per sample)")
    for index, prompt in enumerate(sample_prompts or []):
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(
                f"model.sample_prompts[{index}]={prompt!r}: each prompt must be a non-empty string "
                "(null: the default prompts; []: no samples)"
            )


def _check_prompt_lengths(prompts: list[str], tokenizer: Any, sample_tokens: int, limit: int | None) -> None:
    for index, prompt in enumerate(prompts):
        length = len(tokenizer.encode(prompt))
        if length == 0:
            raise ValueError(f"model.sample_prompts[{index}]={prompt!r}: the tokenizer encodes it to no tokens")
        if limit is not None and length + sample_tokens > limit:
            raise ValueError(
                f"model.sample_prompts[{index}] is {length} tokens: with model.sample_tokens={sample_tokens} "
                f"that passes the model's position limit of {limit} tokens"
            )
