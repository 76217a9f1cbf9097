"""Resuming a run: which penalty weights apply when the command line and the checkpoint differ.

A checkpoint restores each penalty's weight (its extra state). On resume, a weight given on the
command line (``penalty.weight=5``, ``penalties.<name>.weight=...``) replaces the checkpoint's;
a weight that only the config files set does not (the checkpoint's run may have been started
with an override that the resume command does not repeat). Either way a line says which value
applies where the two differ. A ``PenaltyWeightSchedule`` still sets the weights every step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import lightning.pytorch as pl


def weight_overrides(overrides: Iterable[str], penalty_name: str) -> set[str]:
    """The penalties (by their key in the model) whose weight the command line sets:
    ``penalty.weight=...`` is the selected preset ``penalty_name``,
    ``penalties.<name>.weight=...`` is ``<name>``."""
    keys = set()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == "penalty.weight":
            keys.add(penalty_name)
        elif key.startswith("penalties.") and key.endswith(".weight") and key.count(".") == 2:
            keys.add(key.split(".")[1])
    return keys


class ResumedWeights(pl.Callback):
    """After the checkpoint is restored (``on_train_start``), give each penalty in ``explicit``
    its configured weight, and report every penalty whose weight differs from the config's."""

    def __init__(self, configured: Mapping[str, float], explicit: set[str]) -> None:
        self.configured, self.explicit = dict(configured), set(explicit)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name, weight in self.configured.items():
            penalty = pl_module.penalties[name]
            if penalty.weight == weight:
                continue
            if name in self.explicit:
                if trainer.is_global_zero:
                    print(f"resume: penalty {name!r} weight {weight} from the command line "
                          f"(the checkpoint had {penalty.weight})", flush=True)
                penalty.weight = weight
            elif trainer.is_global_zero:
                print(f"resume: penalty {name!r} weight {penalty.weight} from the checkpoint "
                      f"(the config says {weight}; set it on the command line to change it)",
                      flush=True)
