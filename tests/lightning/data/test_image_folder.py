"""data=image_folder on a small folder of PNGs written here: classes, split, pixel values, the
skipped files and the one-line errors for a folder that cannot be used."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchvision")

import numpy as np
from PIL import Image

from gradreg.lightning.data.image_folder import ImageFolderDataModule
from tests.lightning.data.images import (
    COLOURS,
    write_image_folder,
    write_png16,
    write_truncated_jpeg,
)


def test_classes_split_and_pixels(tmp_path: Path) -> None:
    data = ImageFolderDataModule(str(write_image_folder(tmp_path)), shape=(3, 8, 8),
                                 num_classes=3, batch_size=64)
    assert data.classes == ["blue", "red", "white"] and data.num_classes == 3
    # 30 images: round(0.15 * 30) = 4 test, 4 validation, 22 training
    assert {split: len(ds) for split, ds in data.splits.items()} == {"test": 4, "val": 4,
                                                                     "train": 22}
    indices = [i for ds in data.splits.values() for i in ds.indices]
    assert sorted(indices) == list(range(30))  # disjoint and complete
    x, y = next(iter(data.test_dataloader()))
    assert x.shape == (4, 3, 8, 8) and x.dtype == torch.float32
    # ToTensor: pixel / 255 per channel, no standardization; solid colours stay exact
    expected = torch.tensor([COLOURS[data.classes[label]] for label in y]) / 255
    assert torch.equal(x.amax((2, 3)), expected) and torch.equal(x.amin((2, 3)), expected)
    again = ImageFolderDataModule(str(tmp_path), shape=(3, 8, 8), seed=0)
    other = ImageFolderDataModule(str(tmp_path), shape=(3, 8, 8), seed=1)
    assert again.splits["test"].indices == data.splits["test"].indices
    assert other.splits["test"].indices != data.splits["test"].indices


def test_grayscale_shape(tmp_path: Path) -> None:
    data = ImageFolderDataModule(str(write_image_folder(tmp_path, per_class=4)),
                                 shape=(1, 16, 16))
    x, y = data.splits["train"][0]
    # ITU-R 601-2 luma, L = (299 R + 587 G + 114 B) / 1000, rounded to a byte
    luma = {"blue": 29, "red": 76, "white": 255}[data.classes[y]]
    assert x.shape == (1, 16, 16) and torch.allclose(x, torch.full_like(x, luma / 255))


def test_unreadable_files_are_counted_and_skipped(tmp_path: Path) -> None:
    root = write_image_folder(tmp_path, per_class=4)
    (root / "red" / "broken.png").write_bytes(b"not a png")
    (root / "blue" / "notes.txt").write_text("hello")
    with pytest.warns(UserWarning, match="skipped 2 of 14 files that are not readable images"):
        data = ImageFolderDataModule(str(root), shape=(3, 8, 8))
    assert sum(len(ds) for ds in data.splits.values()) == 12


def test_a_clean_folder_warns_nothing(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ImageFolderDataModule(str(write_image_folder(tmp_path, per_class=4)), shape=(3, 8, 8))


def bad_folder(tmp_path: Path, case: str) -> Path | None:
    if case == "not set":
        return None
    if case == "missing":
        return tmp_path / "nowhere"
    if case == "no class folders":
        Image.new("RGB", (4, 4)).save(tmp_path / "loose.png")
        return tmp_path
    root = write_image_folder(tmp_path / "images", per_class=1)
    (root / "empty").mkdir()
    return root


@pytest.mark.parametrize(("case", "message"), [
    ("not set", r"data.root is not set; give the folder of class sub-folders of images: "
                r"data=image_folder data.root=<folder>"),
    ("missing", r"data.root='.*nowhere' is not a folder; give a folder of class sub-folders"),
    ("no class folders", r"has no class sub-folders; put the images in one sub-folder per class"),
    ("a class without images", r"Found no valid file for the classes empty.*add images to those "
                               r"class folders or remove them"),
])
def test_unusable_folders_raise_one_line(tmp_path: Path, case: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        root = bad_folder(tmp_path, case)
        ImageFolderDataModule(None if root is None else str(root))
    assert "\n" not in str(error.value)


def test_class_count_and_tiny_folders_raise_the_fix(tmp_path: Path) -> None:
    root = write_image_folder(tmp_path, per_class=1)
    with pytest.raises(ValueError, match=r"has 3 class folders \['blue', 'red', 'white'\], but "
                                         r"data.num_classes=10; set data.num_classes=3"):
        ImageFolderDataModule(str(root), num_classes=10)
    with pytest.raises(ValueError, match=r"has 3 images, too few for a non-empty test/val split"):
        ImageFolderDataModule(str(root))
    with pytest.raises(ValueError, match=r"data.shape=\[2, 8, 8\] must be \[1 or 3, S, S\]"):
        ImageFolderDataModule(str(root), shape=(2, 8, 8))


def test_16_bit_pngs_are_scaled_to_the_unit_interval(tmp_path: Path) -> None:
    """Constant 16-bit images v: x = round(v / 257) / 255 on every channel (before: any v above
    255 read as 1.0, white)."""
    for name, value in {"a": 1000, "b": 32896, "c": 65535}.items():
        (tmp_path / name).mkdir()
        for i in range(4):
            write_png16(tmp_path / name / f"{i}.png", np.full((16, 16), value))
    data = ImageFolderDataModule(str(tmp_path), shape=(3, 8, 8))
    eight_bit = {"a": 4, "b": 128, "c": 255}  # round(1000 / 257), 32896 / 257, 65535 / 257
    for split in data.splits.values():
        for x, y in split:
            assert torch.equal(x, torch.full((3, 8, 8), eight_bit[data.classes[y]]) / 255)


def test_a_truncated_jpeg_stops_the_build_naming_the_file(tmp_path: Path) -> None:
    """It passes PIL's verify(); before, it stopped a data-loading worker mid-epoch."""
    root = write_image_folder(tmp_path, per_class=4)
    cut = write_truncated_jpeg(root / "red" / "cut.jpg")
    with pytest.raises(ValueError, match=rf"{cut}: the image cannot be decoded \(image file is "
                                         r"truncated") as error:
        ImageFolderDataModule(str(root), shape=(3, 8, 8))
    assert "\n" not in str(error.value)
