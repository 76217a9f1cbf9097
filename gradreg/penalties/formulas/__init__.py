"""The formulas of a penalty, pure functions of tensors: per-sample gradient norms and the
penalty of the norms (:mod:`~gradreg.penalties.formulas.norms`), how the per-sample gradient is
formed (:mod:`~gradreg.penalties.formulas.projections`), the points (interpolates, DRAGAN's
perturbed reals: :mod:`~gradreg.penalties.formulas.points`) and the optimizer correction of
lazy regularization (:mod:`~gradreg.penalties.formulas.lazy`). The lowest layer."""
