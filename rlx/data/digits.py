"""Built-in image task: scikit-learn's bundled digits (1797 8x8 images, offline), split once by data.seed.

The held-out split is the first data.eval_size images of a seeded permutation and train is every
other image (capped by data.train_size), so no eval image is ever trained on, and a smaller eval
split is a prefix of a larger one. At most 597 images are held out, so at least 1200 stay for training.
Labels are the digit as text: score them with reward.name=exact_match (extract=last_number).
"""

from __future__ import annotations

import numpy as np

from rlx.data.rows import DataError, PromptRow
from rlx.media.loading import DIGITS_SCALE_MAX, MediaItem

PROMPT = "<image>\nWhich digit is shown in the image? Reply with only the digit."
MAX_EVAL = 597  # 1797 - 1200: eval may take up to this many images; the rest train


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """(images [N, 8, 8] with values 0..16, labels [N]) from the file scikit-learn ships."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("data.source=digits needs scikit-learn: pip install 'rlx[media]'") from None
    digits = load_digits()
    return digits.images, digits.target


def _rgb(image: np.ndarray) -> np.ndarray:
    """0..16 grey levels -> read-only uint8 RGB 0..255 (ink 16 becomes 255)."""
    grey = np.rint(image * (255 / DIGITS_SCALE_MAX)).astype(np.uint8)
    rgb = np.repeat(grey[:, :, None], 3, axis=2)
    rgb.flags.writeable = False
    return rgb


def _row(index: int, image: np.ndarray, label: int, prompt: str) -> PromptRow:
    return PromptRow(prompt=prompt, label=str(int(label)), metadata={"dataset": "digits", "index": index},
                     source=f"scikit-learn digits image {index}",
                     media={"image": (MediaItem("image", array=_rgb(image)),)})


def digits_splits(train_size: int, eval_size: int, seed: int, prompt: str = PROMPT,
                  ) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train, held-out) rows: disjoint, and the same for the same seed and sizes. `prompt`
    (`data.task_params.prompt`) must hold one `<image>`."""
    if prompt.count("<image>") != 1:
        raise DataError(f"data.task_params.prompt={prompt!r} must hold exactly one <image> placeholder")
    if eval_size > MAX_EVAL:
        raise DataError(f"data.eval_size={eval_size} is more than the digits dataset can hold out ({MAX_EVAL} of "
                        f"its 1797 images, so 1200 stay for training); set data.eval_size<={MAX_EVAL}")
    images, labels = _digits()
    order = np.random.default_rng(seed).permutation(len(images))
    held_out, train = order[:eval_size], order[eval_size:][:train_size]
    rows = [[_row(int(i), images[i], labels[i], prompt) for i in part] for part in (train, held_out)]
    return rows[0], rows[1]
