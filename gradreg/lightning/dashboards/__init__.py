"""TensorBoard dashboards for gradient penalties: one tag scheme
(:mod:`~gradreg.lightning.dashboards.tags`), the custom-scalars layout
(:mod:`~gradreg.lightning.dashboards.charts`), the logger of every step
(:mod:`~gradreg.lightning.dashboards.logger`), the figures
(:mod:`~gradreg.lightning.dashboards.figures`) and a static picture of a logged run
(:mod:`~gradreg.lightning.dashboards.picture`). The callbacks of
:mod:`gradreg.lightning.callbacks` write them; this namespace gathers their public names."""

from gradreg.lightning.dashboards.charts import CHARTS, OUTCOMES, TASK_LOSS, custom_scalars_layout
from gradreg.lightning.dashboards.figures import (
    critic_landscape_figure,
    figure_title,
    saliency_figure,
    samples_figure,
)
from gradreg.lightning.dashboards.logger import TensorBoardLogger
from gradreg.lightning.dashboards.picture import snapshot
from gradreg.lightning.dashboards.tags import (
    AUTOGRAD_GRAPH,
    CRITIC_LANDSCAPE,
    GRAD_NORM,
    GRAD_SPLIT,
    GRAPH_PICTURE,
    INPUT_GRAD,
    INTERPOLATES,
    LOSS_TOTAL,
    PARAM_GRAD,
    PARAM_GRAD_BIAS,
    PENALTY_UNWEIGHTED,
    PENALTY_WEIGHT,
    PENALTY_WEIGHTED,
    SALIENCY,
    SAMPLES,
)

__all__ = [
    "AUTOGRAD_GRAPH",
    "CHARTS",
    "CRITIC_LANDSCAPE",
    "GRAD_NORM",
    "GRAD_SPLIT",
    "GRAPH_PICTURE",
    "INPUT_GRAD",
    "INTERPOLATES",
    "LOSS_TOTAL",
    "OUTCOMES",
    "PARAM_GRAD",
    "PARAM_GRAD_BIAS",
    "PENALTY_UNWEIGHTED",
    "PENALTY_WEIGHT",
    "PENALTY_WEIGHTED",
    "SALIENCY",
    "SAMPLES",
    "TASK_LOSS",
    "TensorBoardLogger",
    "critic_landscape_figure",
    "custom_scalars_layout",
    "figure_title",
    "saliency_figure",
    "samples_figure",
    "snapshot",
]
