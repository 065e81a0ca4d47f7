"""PreferenceModel: private preference tuning (DPO, cDPO, IPO) of a causal LM, one preference pair per privacy unit.

A batch holds each pair as two consecutive rows, its chosen answer then its rejected one (``input_ids``,
``attention_mask``, ``loss_mask`` [B, T] as :class:`~dplit.tasks.language_model.CausalLanguageModel`'s, ``loss_mask``
marking the answer's tokens, and ``chosen`` [B]: 1 on a chosen row, 0 on a rejected one), and under DP-SGD
``privacy_unit`` [B], the pair's id on both rows: the clipping engines then clip each pair's gradient as one unit.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from typing_extensions import override

from dplit.backbone.sharding import shard_frozen_copy
from dplit.privacy.world import ProcessGroup
from dplit.tasks.base import Batch, CausalLMModule, positions_of
from dplit.tasks.preference_loss import PairLogProbs, check_preference_settings, preference_losses
from dplit.tasks.reference import ReferencePolicy

CHOSEN_KEY = "chosen"
"""The batch key marking each row's role: 1 for a pair's chosen answer, 0 for its rejected one."""
REFERENCE_KEY = "dplit_reference_digest"
"""The checkpoint entry holding the digest of the reference the weights were trained against."""
METRICS = ("loss", "reward_accuracy", "margin", "logp_chosen", "logp_rejected")


class PreferenceModel(CausalLMModule):
    """Direct preference optimisation of a causal LM against a frozen reference, under DP-SGD by pair.

    Each pair's loss (:mod:`dplit.tasks.preference_loss`) depends on both its rows, so a pair is one privacy unit:
    :meth:`per_example_loss` puts the pair's loss on its chosen row and 0 on its rejected row, and the engines sum a
    unit's rows before clipping (the gradient still flows through both rows' log-probabilities). The reference is
    the backbone with its peft adapters off, or a frozen copy taken before training
    (:class:`~dplit.tasks.reference.ReferencePolicy`).

    Args:
        beta: β > 0, the pull towards the reference (DPO's temperature, IPO's τ).
        label_smoothing: ε in [0, 0.5): cDPO's assumed share of flipped preferences (``loss_type: sigmoid``).
        loss_type: ``"sigmoid"`` (DPO, cDPO with ``label_smoothing``) or ``"ipo"`` (length-normalised, as TRL).
        **kwargs: the backbone, embedding, adapter, freezing and optimizer arguments of
            :class:`~dplit.tasks.base.CausalLMModule` (``pretrained``, ``config``, ``peft``, ``lr``, ...).
    """

    def __init__(
        self,
        *,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        loss_type: Literal["sigmoid", "ipo"] = "sigmoid",
        **kwargs: Any,
    ) -> None:
        check_preference_settings(beta, label_smoothing, loss_type)
        super().__init__(**kwargs)
        self.apply_freeze()
        self.reference = ReferencePolicy(self.backbone)
        self._totals: dict[str, float] = dict.fromkeys(METRICS, 0.0)
        self._pairs = 0
        self._loaded_reference: str | None = None
        self._sharded_reference: str | None = None

    @override
    def setup(self, stage: str) -> None:
        """Refuse the per-example engine: it traces one row at a time, and a pair's loss needs both."""
        settings = getattr(self.trainer.strategy, "settings", None)
        if getattr(settings, "clipping", None) == "per_example":
            owner = type(self.trainer.strategy).__name__
            raise ValueError(
                f"{owner}.clipping=per_example traces one row at a time, but a preference pair's loss needs both of "
                f"its rows: use {owner}.clipping=ghost"
            )

    @override
    def configure_model(self) -> None:
        """Under a sharded strategy, shard the frozen reference copy as the task (each rank holds a shard of both)."""
        copy = self.reference.copy
        if self.device_mesh is not None and copy is not None and not isinstance(copy, FSDPModule):
            copy.to(next(self.backbone.parameters()).device)
            shard_frozen_copy(copy, self.device_mesh["data_parallel"])
        super().configure_model()

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Also record the reference's digest: a resumed or validated run must compare against the same reference.

        Sharded weights' digest needs every rank; a checkpoint is saved without a collective, so a sharded run records
        the digest its start computed (the reference never changes).
        """
        super().on_save_checkpoint(checkpoint)
        digest = self._sharded_reference if self._is_sharded() else self.reference.digest(self.backbone)
        if digest is not None:
            checkpoint[REFERENCE_KEY] = digest

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the checkpoint's reference digest, checked before the first step or validation batch."""
        super().on_load_checkpoint(checkpoint)
        self._loaded_reference = checkpoint.get(REFERENCE_KEY)

    @override
    def on_train_start(self) -> None:
        """Refuse a resumed run whose reference is not the one its checkpoint trained against."""
        super().on_train_start()
        self._check_reference()

    @override
    def on_validation_start(self) -> None:
        """As :meth:`on_train_start`, for ``dplit dpo validate --ckpt_path``."""
        self._check_reference()

    @override
    def on_test_start(self) -> None:
        """As :meth:`on_train_start`, for ``dplit dpo test --ckpt_path``."""
        self._check_reference()

    def _is_sharded(self) -> bool:
        """Whether the backbone's or the reference copy's weights are FSDP2 shards (``DTensor`` s)."""
        copy = self.reference.copy
        params = [*self.backbone.parameters(), *(copy.parameters() if copy is not None else [])]
        return any(isinstance(param, DTensor) for param in params)

    def _reference_digest(self) -> str:
        """The reference's digest now (every rank calls it under sharding: the shards' digests are gathered)."""
        if not self._is_sharded():
            return self.reference.digest(self.backbone)
        self._sharded_reference = self.reference.digest(self.backbone, gather=ProcessGroup(device=self.device).gather)
        return self._sharded_reference

    def _check_reference(self) -> None:
        """Compare a loaded checkpoint's reference digest with this run's (sharded: also keep it for the saves)."""
        if self._loaded_reference is None and (self._sharded_reference is not None or not self._is_sharded()):
            return  # nothing to compare, and nothing to keep
        digest = self._reference_digest()
        if self._loaded_reference is not None and self._loaded_reference != digest:
            raise ValueError(
                "--ckpt_path: this run's DPO reference (the starting weights: model.pretrained, or model.config with "
                "seed_everything) is not the one the checkpoint was trained against; use the same starting weights"
            )
        self._loaded_reference = None  # checked: the reference never changes after

    @override
    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Next-token logits [B, T, V] of the policy."""
        positions = positions_of(attention_mask)  # [B, T]
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits

    def pair_log_probs(self, batch: Batch) -> PairLogProbs:
        """The four sequence log-probabilities of each pair of ``batch`` (and its answers' token counts)."""
        _check_layout(batch)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        reference_logps, _ = sequence_log_probs(self.reference_logits(ids, mask), batch)  # first, no gradient
        policy_logps, tokens = sequence_log_probs(self(ids, mask), batch)
        policy, ref, counts = policy_logps.view(-1, 2), reference_logps.view(-1, 2), tokens.view(-1, 2)
        return PairLogProbs(policy[:, 0], policy[:, 1], ref[:, 0], ref[:, 1], counts[:, 0], counts[:, 1])

    def reference_logits(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Next-token logits [B, T, V] of the reference, without gradient."""
        with self.reference.active(self.backbone) as reference:  # under torch.no_grad
            if reference is self.backbone:  # adapters off: through the task, whose sharded root gathers its weights
                return self(input_ids, attention_mask)
            positions = positions_of(attention_mask)
            return reference(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits

    def pair_losses(self, pairs: PairLogProbs) -> Tensor:
        """Each pair's loss [P] under the model's β, label smoothing and loss type."""
        hp = self.hparams
        return preference_losses(pairs, beta=hp.beta, label_smoothing=hp.label_smoothing, loss_type=hp.loss_type)

    @override
    def per_example_loss(self, batch: Batch) -> Tensor:
        """One value per row [B]: the pair's loss on its chosen row, 0 on its rejected row (a unit sums to its loss)."""
        if batch["input_ids"].shape[0] == 1 and not batch["attention_mask"].any():
            return self._placeholder_loss(batch)
        losses = self.pair_losses(self.pair_log_probs(batch))  # [P]
        return torch.stack([losses, torch.zeros_like(losses)], dim=1).reshape(-1)  # [2P] = [B]

    def _placeholder_loss(self, batch: Batch) -> Tensor:
        """A sharded rank's placeholder: one empty row whose loss DP-SGD multiplies by 0 ([1]).

        Every rank must run the same passes through the sharded weights: the reference's and the policy's, as for a
        pair, on the placeholder's one row (the engines expect one value per row it has).
        """
        ids, mask = batch["input_ids"], batch["attention_mask"]
        self.reference_logits(ids, mask)
        logps, _ = sequence_log_probs(self(ids, mask), batch)
        return logps

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        """Non-private step: the mean pair loss (DPStrategy replaces it with clipped, noisy micro-batches)."""
        losses = self.pair_losses(self.pair_log_probs(batch))
        self.log("train/loss", losses.mean(), batch_size=max(1, losses.numel()))
        return losses.mean()

    @override
    def on_validation_epoch_start(self) -> None:
        """Reset the validation totals."""
        self._totals, self._pairs = dict.fromkeys(METRICS, 0.0), 0

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        """Accumulate the pairs' losses, reward accuracy, margins and log-probabilities."""
        pairs = self.pair_log_probs(batch)
        margins = pairs.margins(self.hparams.beta)
        values = {
            "loss": self.pair_losses(pairs), "reward_accuracy": (margins > 0).double(), "margin": margins,
            "logp_chosen": pairs.policy_chosen, "logp_rejected": pairs.policy_rejected,
        }  # fmt: skip
        for name, value in values.items():
            self._totals[name] += float(value.detach().double().sum())
        self._pairs += int(margins.numel())

    @override
    def on_validation_epoch_end(self) -> None:
        """Log ``val/loss``, ``val/reward_accuracy``, ``val/margin``, ``val/logp_chosen`` and ``val/logp_rejected``."""
        totals = torch.tensor([*self._totals.values(), float(self._pairs)], device=self.device, dtype=torch.float64)
        totals = self.trainer.strategy.reduce(totals, reduce_op="sum") if self.trainer.world_size > 1 else totals
        count = totals[-1].clamp(min=1)
        for name, total in zip(METRICS, totals[:-1], strict=True):
            bar = name in ("loss", "reward_accuracy")
            self.log(f"val/{name}", float(total / count), prog_bar=bar, batch_size=1, sync_dist=True)

    @override
    def test_step(self, batch: Batch, batch_idx: int) -> None:
        """As :meth:`validation_step`."""
        self.validation_step(batch, batch_idx)

    @override
    def on_test_epoch_start(self) -> None:
        """Reset the totals."""
        self.on_validation_epoch_start()

    @override
    def on_test_epoch_end(self) -> None:
        """Log the totals (under ``val/``, as ``dplit lm test`` does)."""
        self.on_validation_epoch_end()


def sequence_log_probs(logits: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
    """Each row's log-probability of its answer tokens [B] (``loss_mask``), and their count [B]."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    predicted = logits[:, :-1].float() if logits.dtype != torch.float64 else logits[:, :-1]  # [B, T-1, V]
    token_logps = -F.cross_entropy(predicted.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T-1]
    answer = (batch["loss_mask"][:, 1:] * mask[:, 1:] * mask[:, :-1]).to(token_logps.dtype)
    return (token_logps * answer).sum(1), answer.sum(1)


def _check_layout(batch: Batch) -> None:
    """Refuse a batch whose rows are not (chosen, rejected) pairs in turn: its losses would pair the wrong rows."""
    roles = batch.get(CHOSEN_KEY)
    expected = torch.arange(roles.shape[0], device=roles.device) % 2 == 0 if roles is not None else None
    if roles is None or roles.shape[0] % 2 or not torch.equal(roles.bool(), expected):
        raise ValueError(
            f"a preference batch must hold each pair as two rows in turn, chosen then rejected, marked by "
            f"batch[{CHOSEN_KEY!r}] (1, 0, 1, 0, ...): the collate function of dplit.data.preference writes them"
        )
