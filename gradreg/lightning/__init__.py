"""The Lightning layer: LightningModules, callbacks, TensorBoard dashboards and the data modules
(:mod:`gradreg.lightning.data`); no Hydra here.

Import the parts you use, e.g. ``from gradreg.lightning.callbacks import GradientNormMonitor``;
this package only looks up the packages of the ``lightning`` extra, without importing them, so
``import gradreg.lightning`` stays cheap; where one is missing, importing any of its modules fails
with one line naming the extra.
"""

from gradreg.extras import missing_extra

if (missing := missing_extra("lightning", "gradreg.lightning", "lightning", "tensorboard",
                             "matplotlib", "numpy")) is not None:
    raise ImportError(missing)
