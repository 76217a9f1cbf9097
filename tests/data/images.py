"""A small folder of class sub-folders of PNGs, written for the tests (Pillow comes with
matplotlib, so this needs no torchvision)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

# class name -> the RGB colour of all its images
COLOURS = {"blue": (0, 0, 255), "red": (255, 0, 0), "white": (255, 255, 255)}


def write_image_folder(root: Path, per_class: int = 10, size: int = 16) -> Path:
    """``root/<class>/<i>.png``: ``per_class`` solid ``size x size`` images for each of COLOURS."""
    for name, colour in COLOURS.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (size, size), colour).save(root / name / f"{i}.png")
    return root
