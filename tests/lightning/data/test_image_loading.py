"""How data=image_folder reads one image, at the level of PIL (no torchvision needed): 16-bit
PNGs scaled to 8 bits instead of clipped, damaged images refused naming the file, files that are
no image skipped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from gradreg.lightning.data.image_folder import load_image, readable_image
from tests.lightning.data.images import write_png16, write_truncated_jpeg

EXTENSIONS = (".png", ".jpg", ".tif")
# 16-bit values and round(v / 257): 257 k -> k exactly; 1000 / 257 = 3.89 -> 4;
# 65279 / 257 = 254; 65535 / 257 = 255
SIXTEEN = np.array([[0, 257, 32896], [1000, 65279, 65535]])
EIGHT = np.array([[0, 1, 128], [4, 254, 255]])


def test_16_bit_png_is_scaled_not_clipped(tmp_path: Path) -> None:
    path = write_png16(tmp_path / "deep.png", SIXTEEN)
    with Image.open(path) as image:
        assert image.mode == "I;16"
        # what PIL's convert alone gives: every value above 255 clipped to white
        assert np.asarray(image.convert("RGB"))[..., 0].tolist() == [[0, 255, 255],
                                                                    [255, 255, 255]]
    loaded = load_image(str(path))
    assert loaded.mode == "RGB"
    assert np.array_equal(np.asarray(loaded), np.repeat(EIGHT[..., None], 3, axis=2))


def test_8_bit_images_are_read_as_they_are(tmp_path: Path) -> None:
    pixels = np.random.default_rng(1).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "rgb.png")
    Image.fromarray(pixels[..., 0]).save(tmp_path / "gray.png")
    assert np.array_equal(np.asarray(load_image(str(tmp_path / "rgb.png"))), pixels)
    gray = np.asarray(load_image(str(tmp_path / "gray.png")))
    assert np.array_equal(gray, np.repeat(pixels[..., :1], 3, axis=2))


def test_a_truncated_jpeg_is_refused_naming_the_file(tmp_path: Path) -> None:
    """It passes PIL's verify(); before, it failed in a data-loading worker mid-epoch."""
    path = write_truncated_jpeg(tmp_path / "cut.jpg")
    with Image.open(path) as image:
        image.verify()  # the header is whole
    message = rf"{path}: the image cannot be decoded \(image file is truncated"
    with pytest.raises(ValueError, match=message):
        readable_image(str(path), EXTENSIONS)
    with pytest.raises(ValueError, match=message):
        load_image(str(path))


def test_a_damaged_png_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cut.png"
    Image.fromarray(np.zeros((32, 32), dtype=np.uint8)).save(path)
    path.write_bytes(path.read_bytes()[:-20])  # IEND and part of the data lost
    with pytest.raises(ValueError, match=rf"{path}: the image is damaged \("):
        readable_image(str(path), EXTENSIONS)


@pytest.mark.parametrize(("dtype", "mode"), [(np.int32, "I"), (np.float32, "F")])
def test_32_bit_images_without_a_range_are_refused(dtype: type, mode: str,
                                                   tmp_path: Path) -> None:
    path = tmp_path / "wide.tif"
    Image.fromarray(np.full((4, 4), 300, dtype=dtype)).save(path)
    with pytest.raises(ValueError, match=rf"{path}: a TIFF image of mode {mode} \(32-bit values "
                                         r"without a fixed range\) cannot be read as pixels"):
        readable_image(str(path), EXTENSIONS)


def test_files_that_are_no_image_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "noise.png").write_bytes(b"not a png")
    Image.new("RGB", (4, 4)).save(tmp_path / "fine.png")
    (tmp_path / "fine.png").rename(tmp_path / "fine.txt")
    assert not readable_image(str(tmp_path / "noise.png"), EXTENSIONS)
    assert not readable_image(str(tmp_path / "fine.txt"), EXTENSIONS)
