"""Checkpoints of the penalized modules say what they are of, and a resume with another module
or penalty set is refused in words naming both (gradreg.lightning.penalized)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gradreg.lightning.classifier import Classifier
from gradreg.lightning.gan import GAN
from gradreg.lightning.penalized import CHECKPOINT_SCHEMA, checkpoint_mismatch
from gradreg.models import MLP
from gradreg.penalties import double_backprop, jacobian, r1


def classifier(hidden: int = 8, **penalties: object) -> Classifier:
    torch.manual_seed(0)
    return Classifier(MLP(4, 3, hidden=[hidden]), penalties or {"db": double_backprop(0.1)},
                      pgd_steps=0)


def saved(module: L.LightningModule) -> dict:
    """What a checkpoint of ``module`` holds: its state and what on_save_checkpoint adds."""
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    return checkpoint


def test_a_checkpoint_carries_the_schema_the_module_and_its_penalties() -> None:
    assert saved(classifier())["gradreg"] == {
        "schema": 1, "module": "gradreg.lightning.classifier.Classifier",
        "penalties": {"db": "inputs"}}
    gan = GAN(MLP(2, 2, hidden=[4]), MLP(2, 1, hidden=[4]), {"r1": r1(1.0)})
    assert saved(gan)["gradreg"]["penalties"] == {"r1": "real"}


def test_the_same_module_and_penalties_resume() -> None:
    assert checkpoint_mismatch(saved(classifier()), classifier()) is None


def test_another_penalty_set_is_named_with_both_sides() -> None:
    mismatch = checkpoint_mismatch(saved(classifier()), classifier(jac=jacobian(0.1)))
    assert mismatch == ("a checkpoint of Classifier with penalties db (points=inputs); this run "
                        "builds Classifier with penalties jac (points=inputs)")


def test_another_module_class_is_named() -> None:
    gan = GAN(MLP(2, 2, hidden=[4]), MLP(2, 1, hidden=[4]), {"r1": r1(1.0)})
    assert checkpoint_mismatch(saved(gan), classifier()) == (
        "a checkpoint of GAN with penalties r1 (points=real); this run builds Classifier with "
        "penalties db (points=inputs)")


def test_a_checkpoint_without_identity_is_checked_on_its_state() -> None:
    """Written before the identity field: resumable where names and shapes fit."""
    old = saved(classifier())
    del old["gradreg"]
    assert checkpoint_mismatch(old, classifier()) is None
    assert checkpoint_mismatch(old, classifier(hidden=5)) == (
        "a checkpoint of another model than this run's Classifier: it has other shapes: "
        "backbone.fc1.weight [8, 4] (here [5, 4]), backbone.fc1.bias [8] (here [5]), "
        "backbone.out.weight [3, 8] (here [3, 5])")


def test_a_newer_schema_is_refused() -> None:
    newer = saved(classifier())
    newer["gradreg"]["schema"] = CHECKPOINT_SCHEMA + 1
    assert "written by a newer gradreg" in checkpoint_mismatch(newer, classifier())


def test_trainer_fit_from_a_checkpoint_of_other_penalties_raises_naming_both(
        tmp_path: Path) -> None:
    """Before: RuntimeError from load_state_dict, "Unexpected key(s) in state_dict"."""
    data = DataLoader(TensorDataset(torch.rand(8, 4), torch.randint(0, 3, (8,))), batch_size=4)
    options = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False,
               "enable_model_summary": False, "inference_mode": False, "limit_val_batches": 0,
               "enable_checkpointing": False}
    trainer = L.Trainer(max_steps=1, **options)
    trainer.fit(classifier(), data)
    trainer.save_checkpoint(tmp_path / "db.ckpt")
    with pytest.raises(ValueError, match=r"cannot resume from a checkpoint of Classifier with "
                                         r"penalties db \(points=inputs\); this run builds "
                                         r"Classifier with penalties jac"):
        L.Trainer(max_steps=2, **options).fit(classifier(jac=jacobian(0.1)), data,
                                               ckpt_path=tmp_path / "db.ckpt")
