"""Values of the HParams columns that configs/callbacks/hparams.yaml computes (Hydra instantiates
them, as nested ``_target_`` nodes, when it builds the callbacks).

* :func:`effective_weight`: λ as the run uses it, one ``weight`` column for every penalty: 0
  for ``penalty=none``, whatever ``penalty.weight`` the command line gave it (a sweep
  ``penalty=none,double_backprop penalty.weight=0.1,1`` gives ``none`` each weight);
* :func:`log10`: TensorBoard's HParams declaration has no log-scale hint (``HParamInfo`` has a
  name, a type, a domain and whether it differs), so λ and the learning rate also get
  ``weight_log10`` and ``lr_log10`` columns, blank where the value is 0 (``penalty=none``).
"""

from __future__ import annotations

import math

#: the penalty name of a run without a penalty
NO_PENALTY = "none"


def effective_weight(penalty: str, weight: float | None) -> float:
    """λ as the run uses it: 0 for ``penalty=none`` (which ignores ``penalty.weight``) or
    without a weight, else ``weight``."""
    if penalty == NO_PENALTY or weight is None:
        return 0.0
    return float(weight)


def log10(value: float | None) -> float | None:
    """``log10(value)`` for a positive number; None (a blank cell) for 0, a negative number or
    None."""
    if value is None or float(value) <= 0:
        return None
    return math.log10(float(value))
