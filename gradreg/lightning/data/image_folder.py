"""A folder of class sub-folders of images (``root/<class>/<image>``) as a data module.

torchvision's :class:`~torchvision.datasets.ImageFolder` reads the standard layout (classes are
the sub-folder names, sorted; labels their indices) and its transforms make every image a tensor
of ``shape = [C, S, S]``: resized so the shorter side is ``S``, centre-cropped to ``S x S``,
converted to grayscale when ``C = 1``, and scaled to [0, 1] per channel by ``ToTensor`` (pixel /
255). There is no mean/std standardization: attack steps (``fgsm_eps``) and their clipping range
(``input_range: [0, 1]``) are then in pixel units, and a GAN generator ends in a sigmoid.

Images are read by :func:`load_image`: 8-bit images as RGB (PIL's ``convert``), 16-bit
grayscale ones (PNG's, PIL modes ``I;16`` and ``I``) scaled to 8 bits, ``v8 = round(v16 / 257)``
(65535 / 257 = 255: PIL's ``convert`` would clip every value above 255 to white). Every image is
decoded in full when the module is built, so that a damaged one (a truncated JPEG passes PIL's
``verify``) stops the run there, naming the file, and not a data-loading worker mid-epoch.

Nothing is downloaded: the images are the user's. Needs the ``vision`` extra (torchvision),
imported when the module is built: this module and its PIL-level functions import without it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Subset

from gradreg.lightning.data.splits import SplitDataModule, seeded_split
from gradreg.models.torchvision_import import import_torchvision

#: PIL modes of 16-bit grayscale images (the byte orders of ``I;16``)
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N")


def load_image(path: str) -> Image.Image:
    """The image at ``path``, decoded in full, as an 8-bit RGB image.

    16-bit grayscale (modes ``I;16*``, and ``I`` from a PNG, as older PIL releases read 16-bit
    PNGs) becomes 8-bit by ``round(v / 257)``. Other 32-bit integer and floating-point images
    (modes ``I``, ``F``) have no fixed range and are refused. Raises ``ValueError`` naming the
    file for an image that cannot be decoded (truncated, damaged) or used.
    """
    try:
        with Image.open(path) as image:
            image.load()
            if image.mode in SIXTEEN_BIT_MODES or (image.mode == "I" and image.format == "PNG"):
                return _eight_bit(np.asarray(image), path).convert("RGB")
            if image.mode in ("I", "F"):
                raise ValueError(f"{path}: a {image.format} image of mode {image.mode} (32-bit "
                                 "values without a fixed range) cannot be read as pixels; save "
                                 "it as an 8- or 16-bit PNG")
            return image.convert("RGB")
    except (OSError, SyntaxError) as error:  # PIL's errors of damaged files
        raise ValueError(f"{path}: the image cannot be decoded ({error}); replace or remove "
                         "the file") from error


def _eight_bit(values: np.ndarray, path: str) -> Image.Image:
    """16-bit values ``[0, 65535]`` as an 8-bit grayscale image, ``round(v / 257)``."""
    if values.min() < 0 or values.max() > 65535:
        raise ValueError(f"{path}: values from {values.min()} to {values.max()} are not 16-bit "
                         "pixels [0, 65535]; save the image as an 8- or 16-bit PNG")
    return Image.fromarray(np.rint(values / 257).astype(np.uint8))


def readable_image(path: str, extensions: tuple[str, ...]) -> bool:
    """Whether ``path`` is an image to use: it has one of ``extensions`` and PIL recognizes it
    (False: skipped, as a file that is no image). An image PIL recognizes but cannot decode in
    full raises ``ValueError`` naming it: dropping it would change the data set unseen."""
    if not path.lower().endswith(extensions):
        return False
    try:
        with Image.open(path) as image:
            image.verify()
    except UnidentifiedImageError:
        return False
    except Exception as error:  # PIL raises many types for damaged files
        raise ValueError(f"{path}: the image is damaged ({error}); replace or remove the "
                         "file") from error
    load_image(path)
    return True


class ImageFolderDataModule(SplitDataModule):
    """``(x [C, S, S] in [0, 1], label)`` batches from ``root/<class>/<image>``, split by seed.

    Files that are not images (another extension, or not recognized by PIL) are counted and
    skipped with one warning; an image that cannot be decoded in full (truncated, damaged) or
    has no fixed pixel range raises ``ValueError`` naming the file. A missing
    folder, a folder without class sub-folders or without images, a class count other than
    ``num_classes``, or a split left empty raise ``ValueError`` naming the fix.

    Args:
        root: the folder of class sub-folders.
        shape: ``[C, S, S]`` of one sample, ``C`` 1 (grayscale) or 3 (RGB).
        num_classes: the number of class sub-folders expected (the model's output size), or
            ``None`` to accept any.
    """

    def __init__(
        self,
        root: str | None,
        *,
        shape: Sequence[int] = (3, 32, 32),
        num_classes: int | None = None,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 0,
        num_workers: int = 0,
        global_batch: bool = False,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers,
                         global_batch=global_batch, shuffle_seed=seed)
        if root is None:
            raise ValueError("data.root is not set; give the folder of class sub-folders of "
                             "images: data=image_folder data.root=<folder>")
        path = Path(root).expanduser()
        if not path.is_dir():
            raise ValueError(f"data.root={str(root)!r} is not a folder; give a folder of class "
                             "sub-folders of images (root/<class>/<image>.png)")
        channels, *size = (int(s) for s in shape)
        if channels not in (1, 3) or len(size) != 2 or size[0] != size[1]:
            raise ValueError(
                f"data.shape={list(shape)} must be [1 or 3, S, S] for the images of "
                f"{str(root)!r}; it is the model's input shape (model.input_shape): choose a "
                "model for images, model=resnet18 ([3, 32, 32]) or model=cnn, or set "
                "model.input_shape=[C, S, S] for a model of your own")
        class_dirs = sorted(d.name for d in path.iterdir() if d.is_dir())
        if not class_dirs:
            raise ValueError(f"data.root={str(root)!r} has no class sub-folders; put the images "
                             "in one sub-folder per class (root/<class>/<image>.png)")
        self.save_hyperparameters()
        torchvision = import_torchvision("data=image_folder")
        transforms = torchvision.transforms
        # load_image opens every image as 8-bit RGB
        steps = [transforms.Resize(size[0]), transforms.CenterCrop(size[0])]
        steps += [transforms.Grayscale(1)] if channels == 1 else []
        extensions = torchvision.datasets.folder.IMG_EXTENSIONS
        try:
            dataset = torchvision.datasets.ImageFolder(
                str(path), loader=load_image,
                is_valid_file=partial(readable_image, extensions=extensions),
                transform=transforms.Compose([*steps, transforms.ToTensor()]))
        except FileNotFoundError as error:  # a class folder without a readable image
            raise ValueError(f"data.root={str(root)!r}: {error}; add images to those class "
                             "folders or remove them") from error
        self._warn_skipped(path, len(dataset))
        if num_classes is not None and len(dataset.classes) != num_classes:
            raise ValueError(
                f"data.root={str(root)!r} has {len(dataset.classes)} class folders "
                f"{dataset.classes}, but data.num_classes={num_classes}; set "
                f"data.num_classes={len(dataset.classes)}")
        self.classes = dataset.classes
        self.num_classes = len(dataset.classes)
        parts = seeded_split(len(dataset), val_fraction, test_fraction, seed)
        empty = [split for split, idx in parts.items() if len(idx) == 0]
        if empty:
            raise ValueError(f"data.root={str(root)!r} has {len(dataset)} images, too few for a "
                             f"non-empty {'/'.join(empty)} split; add images or raise "
                             "data.val_fraction/data.test_fraction")
        self.splits = {split: Subset(dataset, idx.tolist()) for split, idx in parts.items()}

    @staticmethod
    def _warn_skipped(path: Path, kept: int) -> None:
        """One warning with the number of files in class folders that are not readable images."""
        files = [f for d in path.iterdir() if d.is_dir() for f in d.rglob("*") if f.is_file()]
        skipped = len(files) - kept
        if skipped:
            warnings.warn(f"data.root={str(path)!r}: skipped {skipped} of {len(files)} files that "
                          "are not readable images", stacklevel=3)

