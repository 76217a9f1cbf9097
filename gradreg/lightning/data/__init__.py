"""Data modules: scikit-learn's bundled digits, seeded 2D toy distributions (all offline) and
image folders (:mod:`~gradreg.lightning.data.image_folder`, imported by its path: it needs the
``vision`` extra). Beyond the Lightning layer's packages they need scikit-learn (the ``lightning``
extra): without it, importing them fails with one line naming the extra."""

from gradreg.extras import missing_extra

if (missing := missing_extra("lightning", "gradreg.lightning.data", "sklearn")) is not None:
    raise ImportError(missing)

from gradreg.lightning.data.digits import DigitsDataModule
from gradreg.lightning.data.toy import MIXTURES, TOY_SETS, ToyDataModule, sample_toy

__all__ = ["MIXTURES", "TOY_SETS", "DigitsDataModule", "ToyDataModule", "sample_toy"]
