"""Data modules: scikit-learn's bundled digits and seeded 2D toy distributions (all offline).
They need the ``lightning`` extra: without it, importing them fails with one line naming it."""

from gradreg.extras import missing_extra

if (missing := missing_extra("lightning", "gradreg.data", "lightning", "sklearn")) is not None:
    raise ImportError(missing)

from gradreg.data.digits import DigitsDataModule
from gradreg.data.toy import MIXTURES, TOY_SETS, ToyDataModule, sample_toy

__all__ = ["MIXTURES", "TOY_SETS", "DigitsDataModule", "ToyDataModule", "sample_toy"]
