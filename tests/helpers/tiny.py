"""Tiny offline building blocks for tests: a random-token classification datamodule and model settings."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

TINY_GPT2 = {"n_layer": 2, "n_embd": 16, "n_head": 2, "n_positions": 32}
VOCAB = 40
LABEL_WORDS = [3, 7]


class RandomTokens(Dataset):
    """Random token sequences of random length with a label that depends on the first token."""

    def __init__(self, size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self._examples = []
        for _ in range(size):
            length = int(torch.randint(2, 9, (1,), generator=generator))
            ids = torch.randint(0, VOCAB, (length,), generator=generator)
            self._examples.append((ids, int(ids[0] % 2)))

    def __len__(self) -> int:
        return len(self._examples)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return self._examples[index]


class PadCollate:
    """Right- or left-pads a list of (ids, label) into the batch dict GPT2Classifier expects."""

    def __init__(self, side: str = "right") -> None:
        self._side = side

    def __call__(self, items: list[tuple[Tensor, int]]) -> dict[str, Tensor]:
        """The batch: ``input_ids`` and ``attention_mask`` zero-padded to the longest row, and ``labels``."""
        width = max((len(ids) for ids, _ in items), default=1)
        input_ids = torch.zeros(len(items), width, dtype=torch.long)
        mask = torch.zeros(len(items), width, dtype=torch.long)
        for row, (ids, _) in enumerate(items):
            span = slice(0, len(ids)) if self._side == "right" else slice(width - len(ids), width)
            input_ids[row, span], mask[row, span] = ids, 1
        labels = torch.tensor([label for _, label in items], dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


class RandomTokenData(LightningDataModule):
    """A datamodule of random-token examples (train and validation)."""

    def __init__(self, size: int = 64, batch_size: int = 16, side: str = "right") -> None:
        super().__init__()
        self.train_set, self.val_set = RandomTokens(size, seed=0), RandomTokens(32, seed=1)
        self._batch_size, self._collate = batch_size, PadCollate(side)

    def train_dataloader(self) -> DataLoader:
        """The training examples, shuffled, in batches of ``batch_size``."""
        return DataLoader(self.train_set, batch_size=self._batch_size, shuffle=True, collate_fn=self._collate)

    def val_dataloader(self) -> DataLoader:
        """The 32 validation examples in batches of 16."""
        return DataLoader(self.val_set, batch_size=16, collate_fn=self._collate)
