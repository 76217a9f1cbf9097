"""Train with gradient penalties from a checkout: ``python scripts/train.py [group=option ...]
[key=value ...]``, the same app as the console command ``gradreg-train``
(:mod:`gradreg.app.train`), with this checkout's ``gradreg`` and ``configs/``.

Examples::

    python scripts/train.py                                   # digits MLP + double backprop
    python scripts/train.py experiment=gan_8gaussians_wgan_gp
    python scripts/train.py -m penalty=none,double_backprop   # a sweep, one run per value
    python scripts/train.py --help                            # the groups and their options
"""

import sys
from pathlib import Path

# this checkout's gradreg, installed or not (with `pip install -e .` this changes nothing)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gradreg.app import main

if __name__ == "__main__":
    main()
