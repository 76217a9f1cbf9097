"""Every option of every config group composes (Hydra's compose API) and builds with the app's
own ``build`` (hydra.utils.instantiate), into the objects and values the configs promise."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from gradreg.app.checks.values import check_values
from gradreg.app.sweeps.space import plugin_installed
from gradreg.app.training import build
from gradreg.lightning.classifier import CLASSIFIER_POINTS, Classifier
from gradreg.lightning.gan import GAN
from gradreg.penalties import PRESETS
from tests.lightning.data.images import write_image_folder

from .conftest import compose_config, options

VISION = importlib.util.find_spec("torchvision") is not None
# hparams_search=... needs Optuna (the sweeps extra); logger=mlflow and wandb their packages (the
# trackers extra)
SWEEPS = plugin_installed("optuna")
TRACKERS = {name: plugin_installed(name) for name in ("mlflow", "wandb")}
GAN_SETUP = ["model=gan", "data=8gaussians", "penalty=wgan_gp"]
IMAGE_GAN_SETUP = ["model=dcgan", "data.shape=[1,16,16]", "penalty=r1"]
MOONS_SETUP = ["model.input_shape=[2]", "model.backbone.in_features=2",
               "model.backbone.out_features=2"]


def setup_for(group: str, option: str, tmp_path: Path) -> list[str]:
    """Overrides that make ``group=option`` a complete, consistent configuration."""
    if group == "data" and option == "image_folder":
        root = write_image_folder(tmp_path / "images", per_class=4)
        return ["model=resnet18", f"data.root={root}", "data.num_classes=3"]
    if group == "model" and option == "resnet18":
        return ["model.input_shape=[1,16,16]"]  # the digits, upsampled
    if (group, option) in (("model", "dcgan"), ("callbacks", "image_gan_dashboards")):
        return IMAGE_GAN_SETUP
    if (group, option) == ("callbacks", "gan_dashboards"):
        return GAN_SETUP
    if group == "data" and option in ("8gaussians", "25gaussians", "swissroll"):
        return GAN_SETUP
    if group == "data" and option == "moons":
        return MOONS_SETUP
    if group == "model" and option == "gan":
        return GAN_SETUP
    if (group, option) == ("logger", "mlflow"):  # the store in the test's folder
        return [f"logger.mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    if group == "penalty" and option in PRESETS and PRESETS[option]["points"] not in (
            CLASSIFIER_POINTS):
        return ["model=gan", "data=8gaussians"]
    return []


NEEDS_VISION = {("data", "image_folder"), ("model", "resnet18")}
CASES = [pytest.param(group, option, id=f"{group}={option}", marks=[
    pytest.mark.skipif((group, option) in NEEDS_VISION and not VISION,
                       reason="needs torchvision (vision extra)"),
    pytest.mark.skipif(group == "hparams_search" and not SWEEPS,
                       reason="needs Optuna (sweeps extra)"),
    pytest.mark.skipif(group == "logger" and not TRACKERS.get(option, True),
                       reason=f"needs {option} (trackers extra)")])
    for group in ("data", "model", "penalty", "trainer", "logger", "callbacks", "debug",
                  "experiment", "hparams_search")
    for option in options(group)]


@pytest.mark.parametrize(("group", "option"), CASES)
def test_every_group_option_composes_and_builds(group: str, option: str, tmp_path: Path) -> None:
    """... and passes the app's checks (a shipped option is never refused)."""
    cfg = compose_config([*setup_for(group, option, tmp_path), f"{group}={option}"], tmp_path)
    check_values(cfg)
    if group == "trainer" and option == "gpu":
        assert (cfg.trainer.accelerator, cfg.trainer.devices) == ("gpu", 1)
        if not torch.cuda.is_available():
            cfg.trainer.accelerator = "cpu"  # build everything else on this machine
    datamodule, model, trainer = build(cfg)
    assert isinstance(trainer, L.Trainer)
    assert isinstance(model, GAN if cfg.model._target_.endswith("GAN") else Classifier)
    assert type(datamodule).__name__ == cfg.data._target_.rsplit(".", 1)[1]
    expected = {} if cfg.penalty.name == "none" else {cfg.penalty.name: cfg.penalty.weight}
    expected |= {name: node.weight for name, node in cfg.penalties.items()}
    assert {name: gp.weight for name, gp in model.penalties.items()} == expected
    if group == "penalty" and option in PRESETS:
        assert model.penalties[option].config.points == PRESETS[option]["points"]


def test_defaults_are_the_digits_mlp_with_double_backprop(tmp_path: Path) -> None:
    cfg = compose_config([], tmp_path)
    datamodule, model, trainer = build(cfg)
    assert isinstance(model, Classifier) and list(model.penalties) == ["double_backprop"]
    assert model.penalties["double_backprop"].weight == 0.1
    assert datamodule.splits["train"].tensors[0].shape == (1257, 64)  # flat, for the MLP
    assert trainer.max_epochs == 10
    assert not cfg.trainer.inference_mode  # evaluation takes gradients
    assert isinstance(trainer.logger, TensorBoardLogger)
    assert Path(trainer.logger.log_dir) == tmp_path
    assert Path(trainer.checkpoint_callback.dirpath) == tmp_path / "checkpoints"
    assert isinstance(trainer.checkpoint_callback, ModelCheckpoint)


def test_the_cnn_gets_images(tmp_path: Path) -> None:
    datamodule, model, _ = build(compose_config(["model=cnn"], tmp_path))
    assert datamodule.splits["train"].tensors[0].shape == (1257, 1, 8, 8)
    assert model(datamodule.splits["train"].tensors[0][:5]).shape == (5, 10)


@pytest.mark.parametrize("penalty", ["double_backprop", "none",
                                     "combo_double_backprop_intermediate"])
def test_penalty_weight_on_the_command_line(penalty: str, tmp_path: Path) -> None:
    """``penalty.weight=...`` sets the selected penalty (and composes with penalty=none)."""
    _, model, _ = build(compose_config([f"penalty={penalty}", "penalty.weight=0.7"], tmp_path))
    weights = {name: gp.weight for name, gp in model.penalties.items()}
    assert weights == {"none": {}, "double_backprop": {"double_backprop": 0.7},
                       "combo_double_backprop_intermediate": {"double_backprop": 0.7,
                                                              "hidden": 0.01}}[penalty]


def test_the_gan_experiment_values(tmp_path: Path) -> None:
    cfg = compose_config(["experiment=gan_25gaussians_r1"], tmp_path)
    datamodule, model, _ = build(cfg)
    assert (model.n_critic, model.hparams.loss, datamodule.name) == (1, "nonsaturating",
                                                                       "25gaussians")
    assert (model.penalties["r1"].weight, model.penalties["r1"].config.every) == (0.1, 16)
    assert model.mixture is not None and len(model.mixture[0]) == 25


@pytest.mark.parametrize(("override", "attribute", "value"),
                         [("+penalty.chunks=4", "chunks", 4),
                          ("+penalty.method=finite_difference", "method", "finite_difference"),
                          ("+penalty.subsample=0.25", "subsample", 0.25)])
def test_cost_options_not_in_the_preset_file_take_a_plus(override: str, attribute: str,
                                                         value: object, tmp_path: Path) -> None:
    _, model, _ = build(compose_config(["penalty=double_backprop", override], tmp_path))
    option = getattr(model.penalties["double_backprop"].config, attribute)
    assert (option.name if attribute == "method" else option) == value


def test_any_backbone_target_a_user_names(tmp_path: Path) -> None:
    """``~model.backbone '+model.backbone={_target_: ...}'``: torchvision's SqueezeNet instead of
    the ResNet, on 3 class folders, with its own arguments only."""
    pytest.importorskip("torchvision")
    from torchvision.models import SqueezeNet

    root = write_image_folder(tmp_path / "images", per_class=4)
    cfg = compose_config(["model=resnet18", "data=image_folder", f"data.root={root}",
                          "data.num_classes=3", "~model.backbone",
                          "+model.backbone={_target_:torchvision.models.squeezenet1_1,"
                          "num_classes:3}"], tmp_path)
    datamodule, model, _ = build(cfg)
    assert isinstance(model.backbone, SqueezeNet)
    x, _ = next(iter(datamodule.test_dataloader()))
    assert model(x).shape == (len(x), 3)


@pytest.mark.parametrize(("overrides", "expected"), [
    # one set of keys for both kinds (lr: the classifier's or the critic's), so that both
    # kinds of run in one log folder keep their columns
    (["penalty=none", "callbacks=dashboards"],
     {"penalty": "none", "weight": 0.0, "lr": 0.001, "generator_lr": None, "hidden": [128, 128],
      "channels": None, "width": None, "activation": "relu", "n_critic": None, "loss": None,
      "batch_size": 64, "max_epochs": 10, "seed": 0, "weight_log10": None, "lr_log10": -3.0}),
    (["experiment=gan_8gaussians_wgan_gp", "data.batch_size=128"],
     {"penalty": "wgan_gp", "weight": 0.1, "lr": 1e-4, "generator_lr": 1e-4,
      "hidden": [512, 512, 512], "channels": None, "width": None, "activation": None,
      "n_critic": 5, "loss": "wgan", "batch_size": 128, "max_epochs": 20, "seed": 0,
      "weight_log10": -1.0, "lr_log10": -4.0}),
])
def test_the_hparams_table_has_what_a_sweep_varies(overrides: list[str], expected: dict,
                                                    tmp_path: Path) -> None:
    """Before: only the penalty's name and the seed (no learning rate, widths, batch size or
    epochs; penalty=none had a blank weight)."""
    cfg = compose_config(overrides, tmp_path)
    logger = instantiate(cfg.callbacks.hparams, _convert_="all")
    assert logger.hparams == expected
