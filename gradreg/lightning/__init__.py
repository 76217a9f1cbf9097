"""The Lightning layer: LightningModules, callbacks and TensorBoard dashboards (no Hydra here).

Import the parts you use, e.g. ``from gradreg.lightning.callbacks import GradientNormMonitor``;
this package itself imports nothing, so ``import gradreg.lightning`` stays cheap.
"""
