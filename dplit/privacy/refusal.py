"""SettingError: a refused DP-SGD knob, named by the strategy that takes it (its ``flag_owner``).

Code under ``dplit/privacy/`` does not know which Lightning strategy carries its knobs: it writes :data:`OWNER` where
the strategy's name goes, and the strategy in use names itself when the refusal reaches it (:meth:`SettingError.named`).
"""

from __future__ import annotations

OWNER = "{owner}"
"""Where a refusal's message names the strategy, e.g. ``f"{OWNER}.target_delta={delta:g} must be ..."``."""
DEFAULT_OWNER = "DPStrategy"
"""The name a refusal carries until a strategy names itself (the data-parallel strategy, used most)."""


class SettingError(ValueError):
    """A knob (or a plan of knobs) DP-SGD refuses, in one line naming ``<strategy>.<knob>``.

    Args:
        message: the line, with :data:`OWNER` where the strategy's name goes.
        owner: the strategy's name.
    """

    def __init__(self, message: str, *, owner: str = DEFAULT_OWNER) -> None:
        self.message = message
        super().__init__(message.replace(OWNER, owner))

    def named(self, owner: str) -> SettingError:
        """The same refusal naming ``owner``'s knobs."""
        return SettingError(self.message, owner=owner)
