"""What a penalty refuses and checks: points and outputs it would get wrong
(:mod:`~gradreg.penalties.guards.checks`), coupled samples
(:mod:`~gradreg.penalties.guards.coupling`), non-finite values
(:mod:`~gradreg.penalties.guards.finite`), arithmetic too coarse for a difference and the step
that balances rounding (:mod:`~gradreg.penalties.guards.precision`), compiled models
(:mod:`~gradreg.penalties.guards.compiled`) and single option values
(:mod:`~gradreg.penalties.guards.options`). Floor 1 of ``gradreg.penalties``: it stands on the
state of a call (``state/``, floor 0) alone."""
