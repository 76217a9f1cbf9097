"""The app's penalty configs (``configs/penalty/*.yaml``) take their values from the presets:
every option they write equals the preset's (or, where the preset leaves it out, the
configuration's default), so ``penalty=<name>`` in the app and ``make_penalty(<name>)`` in a
plain loop compute one penalty."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gradreg.penalties import PRESETS
from gradreg.penalties.config import FLAT

omegaconf = pytest.importorskip("omegaconf")

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "penalty"
DEFAULTS = FLAT
#: What a config may set otherwise: the training loop's lazy interval (the presets compute on
#: every step, so a plain loop needs no ``due()``; the app's path length recipe is StyleGAN2's 4)
#: and the model's own submodule names (``intermediate`` has no default layers).
THE_APPS_OWN = ("every", "layers")


def _penalties(node: Any) -> list[dict]:
    """Every ``make_penalty`` entry of a config, at its top or nested (``penalties:``)."""
    if not isinstance(node, dict):
        return []
    found = [node] if node.get("_target_") == "gradreg.penalties.make_penalty" else []
    return found + [entry for value in node.values() for entry in _penalties(value)]


def _entries() -> list[tuple[str, dict]]:
    return [(f"{path.stem}:{entry['name']}", entry)
            for path in sorted(CONFIGS.glob("*.yaml"))
            for entry in _penalties(omegaconf.OmegaConf.to_container(
                omegaconf.OmegaConf.load(path), resolve=True))]  # sam's step: ${.weight}


def test_every_preset_has_its_config() -> None:
    names = {entry["name"] for _, entry in _entries()}
    assert names == set(PRESETS)


@pytest.mark.parametrize(("label", "entry"), _entries(), ids=[label for label, _ in _entries()])
def test_a_config_writes_the_presets_values(label: str, entry: dict) -> None:
    preset = {**DEFAULTS, **PRESETS[entry["name"]]}
    written = {key: value for key, value in entry.items()
               if key not in ("_target_", "name", *THE_APPS_OWN)}
    assert "weight" in written  # so that penalty.weight=... needs no "+"
    differing = {key: (value, preset.get(key, "not an option"))
                 for key, value in written.items()
                 if preset.get(key, "not an option") != (tuple(value) if isinstance(value, list)
                                                         else value)}
    assert differing == {}, f"{label}: written value, preset value: {differing}"
