"""The warning category of settings that weaken or void the privacy guarantee (shown prominently by ``dplit``)."""

from __future__ import annotations


class PrivacyWarning(UserWarning):
    """A setting or event that weakens, voids or ends the privacy guarantee of a run (never filtered by dplit)."""
