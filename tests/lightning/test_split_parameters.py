"""GradientSplit on a Classifier whose parameter penalty takes the task's gradient (two passes):
the terms are split for the callback, and the step's gradient is still SAM's."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from gradreg.lightning.callbacks import GradientSplit
from gradreg.lightning.classifier import Classifier
from gradreg.models import MLP
from gradreg.penalties import sam
from tests.lightning.helpers import events, trainer
from tests.lightning.test_split import Recorder, digits_like


def test_a_split_sam_step_is_sams_gradient_and_its_parts_are_logged(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Classifier(MLP(6, 3, hidden=[5]).double(), {"sam": sam(0.05)}, pgd_steps=0,
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
    recorder = Recorder()
    run = trainer(tmp_path, [GradientSplit(every_n_steps=1), recorder], max_steps=2)
    run.fit(module, digits_like())
    for (before, (x, y)), applied in zip(recorder.before, recorder.grads, strict=True):
        params = list(before.parameters())
        g = torch.autograd.grad(F.cross_entropy(before(x), y), params)
        norm = torch.sqrt(sum(t.square().sum() for t in g))
        with torch.no_grad():
            for p, t in zip(params, g, strict=True):
                p.add_(t * (0.05 / norm))
        ascent = torch.autograd.grad(F.cross_entropy(before(x), y), params)
        names = [name for name, _ in before.named_parameters()]
        for name, want in zip(names, ascent, strict=True):
            torch.testing.assert_close(applied[f"backbone.{name}"], want, rtol=1e-10,
                                       atol=1e-13)
    logged = events(run)
    assert len(logged.Scalars("grad_split/penalty_share/backbone.fc1")) == 2
