"""Per-example gradient norm rules by layer type, and the factorised-gradient algebra they share."""

from dplit.privacy.clipping.norms import conv1d, elementwise_affine, embedding, layer_norm, linear  # noqa: F401  (registers the rules)
from dplit.privacy.clipping.norms.factors import (
    DenseFactor,
    ExampleGradient,
    FactoredGradient,
    GradientUse,
    IndexFactor,
    add_weighted_sum_,
    concatenate,
    factor_gram,
    inner_product,
    materialise,
    squared_norm,
    weighted_sum,
)
from dplit.privacy.clipping.norms.registry import NORM_RULES, GradientRule, NormRule, register_norm_rule

__all__ = [
    "NORM_RULES",
    "DenseFactor",
    "ExampleGradient",
    "FactoredGradient",
    "GradientRule",
    "GradientUse",
    "IndexFactor",
    "NormRule",
    "add_weighted_sum_",
    "concatenate",
    "factor_gram",
    "inner_product",
    "materialise",
    "register_norm_rule",
    "squared_norm",
    "weighted_sum",
]
