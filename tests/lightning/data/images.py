"""A small folder of class sub-folders of PNGs, and damaged or 16-bit images, written for the
tests (Pillow comes with matplotlib, so this needs no torchvision)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
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


def write_truncated_jpeg(path: Path, size: int = 64) -> Path:
    """A JPEG of random pixels cut to 70% of its bytes: its header is whole, so PIL opens and
    ``verify``-s it, and decoding its pixels fails ('image file is truncated')."""
    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, quality=90)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 7 // 10])
    return path


def write_png16(path: Path, values: np.ndarray) -> Path:
    """A 16-bit grayscale PNG of ``values`` (uint16), which PIL reads as mode ``I;16``."""
    Image.fromarray(values.astype(np.uint16)).save(path)
    return path
