"""Callbacks that show what a gradient penalty does, for any LightningModule.

* :class:`GradientNormMonitor`: losses, parameter gradient norms and histograms, penalties
  (unweighted, weighted, weights), input gradient norms;
* :class:`GradientSplit`: per layer, the parameter gradient's part from the penalties and from
  the task loss;
* :class:`PenaltyBaseline`: the unweighted penalty of a run without one, a baseline;
* :class:`InterpolatesGradientNorm`: a critic's gradient norm at WGAN-GP's interpolates;
* :class:`PenaltyWeightSchedule`: warm-up and anneal of penalty weights (checkpointed);
* :class:`AccumulationGuard`: gradients not reset between optimizer steps, NaN/Inf gradients;
* :class:`AutogradGraphLogger`: the backward graph of the penalized loss, as a picture, text and
  DOT;
* :class:`CustomScalarsLayout`: TensorBoard layout with loss, penalties and norms side by side;
* :class:`HParamsLogger`: hyperparameters with final metrics (HParams tab);
* :class:`SaliencyMaps`: figure of inputs over their loss gradient;
* :class:`CriticLandscape`: figure of a 2D critic's scores and gradient norms, with samples;
* :class:`SampleGrid`: a grid of generated images of fixed latents;
* :class:`ProgressLog`: lines of progress where no progress bar is drawn (output to a file).

The tags they write are listed in :mod:`gradreg.lightning.dashboards`.
"""

from gradreg.lightning.callbacks.baseline import PenaltyBaseline
from gradreg.lightning.callbacks.figures import CriticLandscape, SaliencyMaps
from gradreg.lightning.callbacks.graph import AutogradGraphLogger
from gradreg.lightning.callbacks.guard import AccumulationGuard
from gradreg.lightning.callbacks.hparams import HParamsLogger
from gradreg.lightning.callbacks.interpolates import InterpolatesGradientNorm
from gradreg.lightning.callbacks.layout import CustomScalarsLayout
from gradreg.lightning.callbacks.monitor import GradientNormMonitor
from gradreg.lightning.callbacks.progress_log import ProgressLog
from gradreg.lightning.callbacks.samples import SampleGrid
from gradreg.lightning.callbacks.schedule import PenaltyWeightSchedule, WeightSchedule
from gradreg.lightning.callbacks.split import GradientSplit

__all__ = [
    "AccumulationGuard",
    "AutogradGraphLogger",
    "CriticLandscape",
    "CustomScalarsLayout",
    "GradientNormMonitor",
    "GradientSplit",
    "HParamsLogger",
    "InterpolatesGradientNorm",
    "PenaltyBaseline",
    "PenaltyWeightSchedule",
    "ProgressLog",
    "SaliencyMaps",
    "SampleGrid",
    "WeightSchedule",
]
