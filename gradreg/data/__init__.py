"""Data modules: scikit-learn's bundled digits and seeded 2D toy distributions (all offline).
They need the ``lightning`` extra: without it, importing them fails with one line naming it."""

from gradreg.extras import require

require("lightning", "gradreg.data", "lightning", "sklearn")

from gradreg.data.digits import DigitsDataModule  # noqa: E402  (after the check of the extra)
from gradreg.data.toy import MIXTURES, TOY_SETS, ToyDataModule, sample_toy  # noqa: E402

__all__ = ["MIXTURES", "TOY_SETS", "DigitsDataModule", "ToyDataModule", "sample_toy"]
