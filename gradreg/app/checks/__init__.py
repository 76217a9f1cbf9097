"""What the app refuses before training, in one line and status 2: its one error,
:class:`~gradreg.app.checks.errors.ConfigError`, and how a run ends with it (:mod:`.errors`);
the command line's overrides and the composed configuration's values (:mod:`.values`); the
folders and checkpoints a run reads and writes (:mod:`.paths`); what Hydra meets before the run
(:mod:`.hydra_errors`). Importing this package imports nothing."""
