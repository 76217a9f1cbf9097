"""A folder of class sub-folders of images (``root/<class>/<image>``) as a data module.

torchvision's :class:`~torchvision.datasets.ImageFolder` reads the standard layout (classes are
the sub-folder names, sorted; labels their indices) and its transforms make every image a tensor
of ``shape = [C, S, S]``: resized so the shorter side is ``S``, centre-cropped to ``S x S``,
converted to grayscale when ``C = 1``, and scaled to [0, 1] per channel by ``ToTensor`` (pixel /
255). There is no mean/std standardization: attack steps (``fgsm_eps``) and their clipping range
(``input_range: [0, 1]``) are then in pixel units, and a GAN generator ends in a sigmoid.

Nothing is downloaded: the images are the user's. Needs the ``vision`` extra (torchvision).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

from torch.utils.data import Subset

from gradreg.data.splits import SplitDataModule, seeded_split
from gradreg.models.torchvision_import import import_torchvision

import_torchvision("data=image_folder")

from PIL import Image  # noqa: E402  (torchvision installs it)
from torchvision import transforms  # noqa: E402
from torchvision.datasets import ImageFolder  # noqa: E402
from torchvision.datasets.folder import IMG_EXTENSIONS  # noqa: E402


def readable_image(path: str) -> bool:
    """Whether ``path`` has an image extension and PIL can decode its header and data."""
    if not path.lower().endswith(IMG_EXTENSIONS):
        return False
    try:
        with Image.open(path) as image:
            image.verify()
    except Exception:  # PIL raises many types for broken files
        return False
    return True


class ImageFolderDataModule(SplitDataModule):
    """``(x [C, S, S] in [0, 1], label)`` batches from ``root/<class>/<image>``, split by seed.

    Files that are not readable images are counted and skipped with one warning. A missing
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
        channels, *size = (int(s) for s in shape)
        if channels not in (1, 3) or len(size) != 2 or size[0] != size[1]:
            raise ValueError(f"data.shape={list(shape)} must be [1 or 3, S, S]")
        if root is None:
            raise ValueError("data.root is not set; give the folder of class sub-folders of "
                             "images: data=image_folder data.root=<folder>")
        path = Path(root).expanduser()
        if not path.is_dir():
            raise ValueError(f"data.root={str(root)!r} is not a folder; give a folder of class "
                             "sub-folders of images (root/<class>/<image>.png)")
        class_dirs = sorted(d.name for d in path.iterdir() if d.is_dir())
        if not class_dirs:
            raise ValueError(f"data.root={str(root)!r} has no class sub-folders; put the images "
                             "in one sub-folder per class (root/<class>/<image>.png)")
        self.save_hyperparameters()
        # ImageFolder's loader opens every image as RGB
        steps = [transforms.Resize(size[0]), transforms.CenterCrop(size[0])]
        steps += [transforms.Grayscale(1)] if channels == 1 else []
        try:
            dataset = ImageFolder(str(path), is_valid_file=readable_image,
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

