"""The Lightning adapters of DP-SGD: ``dplit.strategy.DPStrategy`` (DDP) and ``dplit.strategy.ShardedDPStrategy`` (FSDP2).

* :mod:`~dplit.strategy.strategies`: the two strategies, thin adapters over Lightning's DDP and FSDP2 strategies;
* :mod:`~dplit.strategy.hooks`: ``DPSGDHooks``, when Lightning calls :class:`~dplit.privacy.dpsgd.DPSGD` (loader, step,
  checkpoints, interrupts), for every DP strategy;
* :mod:`~dplit.strategy.checks`: what a DP strategy refuses in a Trainer or module before any data is read;
* :mod:`~dplit.strategy.step_logging`: what a DP step logs (``privacy/*`` public; ``train/*``, ``dp/*`` private);
* :mod:`~dplit.strategy.interrupted_run`: ``interrupted.ckpt``, the finished DP steps kept with their ledger.

Configs name ``dplit.strategy.DPStrategy`` (the class path since the first release).
"""

from dplit.strategy.interrupted_run import INTERRUPT_CHECKPOINT
from dplit.strategy.strategies import NO_NOISE_WARNING, DPStrategy, ShardedDPStrategy

__all__ = ["INTERRUPT_CHECKPOINT", "NO_NOISE_WARNING", "DPStrategy", "ShardedDPStrategy"]
