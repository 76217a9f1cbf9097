"""Data modules: scikit-learn's bundled digits and seeded 2D toy distributions (all offline)."""

from gradreg.data.digits import DigitsDataModule
from gradreg.data.toy import MIXTURES, TOY_SETS, ToyDataModule, sample_toy

__all__ = ["MIXTURES", "TOY_SETS", "DigitsDataModule", "ToyDataModule", "sample_toy"]
