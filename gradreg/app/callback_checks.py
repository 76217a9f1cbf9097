"""The dashboard callbacks of a configuration checked against its model: a callback made for
another kind of model (a classifier has no critic; a 2D landscape of an image critic means
nothing) is refused before training instead of failing in it."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from .errors import ConfigError

GAN_2D, GAN_IMAGES = "GAN on 2D points", "GAN on images"
#: callbacks made for some kinds of model: class -> (those kinds, how a message names them)
CALLBACK_KINDS: dict[str, tuple[set[str], str]] = {
    "SaliencyMaps": ({"Classifier"}, "a Classifier"),
    "InterpolatesGradientNorm": ({GAN_2D, GAN_IMAGES}, "a GAN"),
    "CriticLandscape": ({GAN_2D}, f"a {GAN_2D}"),
    "SampleGrid": ({GAN_IMAGES}, f"a {GAN_IMAGES}"),
}
#: the callbacks config made for each kind of model
DASHBOARDS = {"Classifier": "dashboards", GAN_2D: "gan_dashboards",
              GAN_IMAGES: "image_gan_dashboards"}


def _model_kind(cfg: DictConfig) -> str | None:
    """Classifier, GAN on 2D points or GAN on images (its data has ``shape``); None for a
    model class of the user's."""
    name = str(cfg.model.get("_target_", "")).rpartition(".")[2]
    if name == "GAN":
        shape = OmegaConf.select(cfg, "data.shape", throw_on_resolution_failure=False)
        return GAN_IMAGES if shape is not None else GAN_2D
    return name if name == "Classifier" else None


def check_callbacks(cfg: DictConfig) -> None:
    """A dashboard callback made for another kind of model fails mid-training (a classifier
    has no critic; a 2D landscape of an image critic means nothing): refuse it up front."""
    kind = _model_kind(cfg)
    for name, node in (cfg.get("callbacks") or {}).items():
        target = str(node.get("_target_", "")) if isinstance(node, DictConfig) else ""
        kinds, described = CALLBACK_KINDS.get(target.rpartition(".")[2], (None, ""))
        if kind is not None and kinds is not None and kind not in kinds:
            raise ConfigError(
                f"callbacks: {target.rpartition('.')[2]} (callbacks.{name}) is for {described}, "
                f"but the model is a {kind}; use callbacks={DASHBOARDS[kind]} (or default, "
                "none)"
            )
