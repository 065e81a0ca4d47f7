"""Privacy accounting for Poisson-sampled DP-SGD: ε so far, σ calibration, the working range, neighbouring relations."""

from dplit.privacy.accounting.accountant import PrivacyAccountant, default_delta
from dplit.privacy.accounting.calibration import calibrate_noise_multiplier
from dplit.privacy.accounting.checks import check_accountable
from dplit.privacy.accounting.limits import (
    DELTA_MAX,
    EPSILON_MAX,
    NOISE_MULTIPLIER_MAX,
    PRV_MAX_GRID,
    PRV_MIN_DELTA,
    History,
    Mechanism,
)

__all__ = [
    "DELTA_MAX", "EPSILON_MAX", "NOISE_MULTIPLIER_MAX", "PRV_MAX_GRID", "PRV_MIN_DELTA", "History", "Mechanism",
    "PrivacyAccountant", "calibrate_noise_multiplier", "check_accountable", "default_delta",
]  # fmt: skip
