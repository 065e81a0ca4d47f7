"""CausalLanguageModel: DP-SGD fine-tuning for text generation (next-token prediction on a user's corpus)."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor
from typing_extensions import override

from dplit.tasks.base import Batch, CausalLMModule, positions_of

DEFAULT_SAMPLE_PROMPTS = ("the movie", "this film is")


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

    SHARDED_ENTRY_POINTS = ("generate_text",)

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

    @override
    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Next-token logits [B, T, V] (the one way to the backbone: a sharded model gathers its weights here)."""
        positions = positions_of(attention_mask)  # [B, T]
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits

    def token_losses(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """Cross-entropy of each predicted token [B, T-1] and the mask of trained predictions [B, T-1]."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        logits = self(ids, mask)  # [B, T, V]
        predicted = logits[:, :-1].float()  # [B, T-1, V]: position t predicts token t + 1
        losses = F.cross_entropy(predicted.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T-1]
        trained = (batch["loss_mask"][:, 1:] * mask[:, 1:] * mask[:, :-1]).to(losses.dtype)  # [B, T-1]
        return losses * trained, trained

    @override
    def per_example_loss(self, batch: Batch) -> Tensor:
        """Each example's summed (or mean) token loss [B]; example i's loss depends on example i only."""
        losses, trained = self.token_losses(batch)
        total = losses.sum(1)  # [B]
        return total if self.hparams.loss_reduction == "sum" else total / trained.sum(1).clamp(min=1)

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        """Non-private step (DPStrategy replaces it with clipped, noisy micro-batches)."""
        loss = self.per_example_loss(batch).mean()
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
