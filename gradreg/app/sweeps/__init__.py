"""Sweeps and searches: the keys a multirun varies and the packages it needs (:mod:`.space`), the
jobs of a grid (:mod:`.grid`), an Optuna study in a database (:mod:`.search`, :mod:`.pruning`,
:mod:`.trials`, :mod:`.search_report`), and what a sweep's jobs measured (:mod:`.results`) as a
table (:mod:`.table`), a figure (:mod:`.figure`) and the sweep's summary (:mod:`.summary`).
Importing this package imports nothing; its modules need Hydra (the app extra), and
:mod:`.search` and :mod:`.pruning` Optuna (the sweeps extra)."""
