"""The formulas of a penalty, pure functions of tensors: per-sample gradient norms and the
penalty of the norms (:mod:`~gradreg.penalties.formulas.norms`), how the per-sample gradient is
formed (:mod:`~gradreg.penalties.formulas.projections`) and the norm a penalty takes
(:mod:`~gradreg.penalties.formulas.options`). Floor 2 of ``gradreg.penalties``: it stands on
the checks (``guards/``, floor 1) and the state of a call (``state/``, floor 0)."""
