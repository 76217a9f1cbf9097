"""The custom-scalars layout: which tags TensorBoard's Custom Scalars tab draws on one chart, in
which order (:data:`CHARTS`), and the layout of a run (:func:`custom_scalars_layout`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from gradreg.lightning.dashboards.tags import (
    GRAD_NORM,
    GRAD_SPLIT,
    INPUT_GRAD,
    INTERPOLATES,
    LOSS_TOTAL,
    PENALTY_UNWEIGHTED,
    PENALTY_WEIGHT,
    PENALTY_WEIGHTED,
)

CATEGORY = "gradreg"
# the end of an outcome chart's title: TensorBoard's default smoothing (0.6) and "ignore outliers
# in chart scaling" can hide a run's first and final values (a GAN's energy distance falls
# steeply), which the HParams table lists as they are
FINAL = " (validation; final values: HParams tab, smoothing and 'ignore outliers' hide them)"
# the modules' training task losses: the classifier's (and a user's) train/loss, the GAN's
# adversarial terms train/critic/adversarial and train/generator/adversarial
TASK_LOSS = (r"train/loss$", r"train/[^/]+/adversarial$")

# chart key -> (title, regexes); a regex matches a tag from its start (re.match). "task_loss"
# takes the caller's regexes; "penalty_unweighted" becomes one chart per penalty where the caller
# names them (penalties of different kinds have different scales), "grad_split" one chart per
# layer where the caller names the layers. The order is the layout's: the outcome first (what a
# sweep is judged by, one metric per chart, so that a sweep's many runs stay readable), then the
# terms of the loss, then the gradients.
CHARTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "accuracy": (f"outcome: val/acc, clean accuracy{FINAL}", (r"val/acc$",)),
    "accuracy_fgsm": (f"outcome: val/acc_fgsm, accuracy under FGSM{FINAL}", (r"val/acc_fgsm$",)),
    "accuracy_pgd": (f"outcome: val/acc_pgd, accuracy under PGD{FINAL}", (r"val/acc_pgd$",)),
    "energy_distance": (f"outcome: val/energy_distance to held-out samples{FINAL}",
                        (r"val/energy_distance$",)),
    "feature_energy_distance": (f"outcome: val/feature_energy_distance{FINAL}",
                                (r"val/feature_energy_distance$",)),
    "modes": (f"outcome: val/modes covered{FINAL}", (r"val/modes$",)),
    "task_loss": ("task loss (train)", TASK_LOSS),
    "penalty_weighted": ("penalties, weighted: λ·P as added to the loss",
                         (rf"{PENALTY_WEIGHTED}/.*",)),
    "penalty_unweighted": ("penalties, unweighted P", (rf"{PENALTY_UNWEIGHTED}/.*",)),
    "grad_split": ("penalty's share of the parameter gradient per layer, "
                   "‖g_pen‖ / (‖g_task‖ + ‖g_pen‖)", (rf"{GRAD_SPLIT}/penalty_share/.*",)),
    "grad_norm": ("parameter gradient norm ‖∂L/∂θ‖ per optimizer", (rf"{GRAD_NORM}/total(/.*)?$",)),
    "input_grad": ("input gradient norm ‖∇x ℓ‖: batch mean and max",
                   (rf"{INPUT_GRAD}/norm_(mean|max)$",)),
    "interpolates": ("critic gradient norm ‖∇D(x̂)‖ at interpolates: mean and target",
                     (rf"{INTERPOLATES}/grad_norm_(mean|target)$",)),
    "loss_total": ("loss + penalty (train): what is backpropagated", (rf"{LOSS_TOTAL}(/.*)?$",)),
    "penalty_weight": ("penalty weights λ", (rf"{PENALTY_WEIGHT}/.*",)),
}
#: the outcome charts of :data:`CHARTS` (``CustomScalarsLayout(outcome=...)``), one metric each
OUTCOMES = ("accuracy", "accuracy_fgsm", "accuracy_pgd", "energy_distance",
            "feature_energy_distance", "modes")


def custom_scalars_layout(
    loss: Sequence[str] = TASK_LOSS, charts: Iterable[str] | None = None,
    category: str = CATEGORY, penalties: Sequence[str] = (), layers: Sequence[str] = (),
) -> dict[str, dict[str, list]]:
    """The layout for ``SummaryWriter.add_custom_scalars``: the ``charts`` of :data:`CHARTS`.

    Each chart is ``["Multiline", [regex, ...]]``; TensorBoard draws every scalar tag that a regex
    matches from its start (``re.match``). ``loss`` are the regexes of the training task-loss tags
    (the module's own ``self.log`` names); ``charts`` the keys of :data:`CHARTS` to include (all
    by default), drawn in :data:`CHARTS`' order; ``penalties`` the module paths of the penalties
    (``penalties.r1``): "penalties, unweighted P" is then one chart per penalty, each on its own
    scale; ``layers`` the layers of :class:`~gradreg.lightning.callbacks.GradientSplit`: the
    gradient split is then one chart per layer of ``‖g_task‖`` and ``‖g_pen‖`` (each run's two
    lines on one chart of its own, instead of every layer of every run in one). TensorBoard
    merges the layouts of the runs of a log folder, keeping one copy of equal charts: runs of
    both module kinds with the default ``loss`` get one chart of each title.
    """
    keys = set(CHARTS if charts is None else charts)
    unknown = sorted(keys - set(CHARTS))
    if unknown:
        raise ValueError(f"unknown charts {unknown}; the charts are {list(CHARTS)}")
    layout: dict[str, list] = {}
    for key, (title, regexes) in CHARTS.items():
        if key not in keys:
            continue
        if key == "penalty_unweighted" and penalties:
            for path in penalties:
                layout[f"penalty {path.rsplit('.', 1)[-1]}, unweighted P"] = [
                    "Multiline", [rf"{PENALTY_UNWEIGHTED}/{re.escape(path)}$"]]
            continue
        if key == "grad_split" and layers:
            for layer in layers:
                layout[f"gradient of layer {layer}: ‖∂L_task/∂θ‖ and ‖∂(λ·P)/∂θ‖"] = [
                    "Multiline", [rf"{GRAD_SPLIT}/(task|penalty)/{re.escape(layer)}$"]]
            continue
        layout[title] = ["Multiline", list(loss if key == "task_loss" else regexes)]
    return {category: layout}
