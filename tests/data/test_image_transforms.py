"""The image transforms (megatron_ext/data/image_transforms.py): torchvision's RandomResizedCrop box rules, a
training transform that is deterministic per seed and keeps the crop's region when JPEG draft-decodes it smaller, and
the evaluation transform (shorter side resized, then the centre crop)."""

import io

import numpy as np
from PIL import Image

from megatron_ext.data import image_transforms as tf


def encode(pixels, fmt="PNG"):
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def test_random_resized_crop_box_follows_torchvision_rules():
    areas = []
    for k in range(300):
        left, top, right, bottom = tf.random_resized_crop_box(64, 48, np.random.default_rng(k))
        w, h = right - left, bottom - top
        assert 0 <= left < right <= 64 and 0 <= top < bottom <= 48
        assert 0.08 * 64 * 48 * 0.9 <= w * h <= 64 * 48 and 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1
        areas.append(w * h / (64 * 48))
    assert min(areas) < 0.2 and max(areas) > 0.8  # the scale range is used, not one size
    # a 1000x10 strip: no try fits (any allowed box of 8% of the area is over 10 high), so the central 13x10
    assert tf.random_resized_crop_box(1000, 10, np.random.default_rng(0)) == (493, 0, 506, 10)


def test_train_transform_is_deterministic_and_draft_keeps_the_region():
    yy, xx = np.mgrid[0:512, 0:384]
    smooth = np.stack([xx * 255 // 383, yy * 255 // 511, (xx + yy) * 255 // 895], -1).astype(np.uint8)
    jpeg = encode(smooth, "JPEG")
    flips, drafted = set(), 0
    for k in range(8):
        a = tf.train_image(jpeg, 48, np.random.default_rng([7, 0, k]), draft=False)
        assert np.array_equal(a, tf.train_image(jpeg, 48, np.random.default_rng([7, 0, k]), draft=False))
        b = tf.train_image(jpeg, 48, np.random.default_rng([7, 0, k]), draft=True)
        assert a.shape == b.shape == (48, 48, 3) and np.abs(a.astype(int) - b).mean() < 3
        drafted += not np.array_equal(a, b)
        flips.add(bool(a[0, 0, 0] > a[0, -1, 0]))  # red grows to the right unless flipped
    assert flips == {True, False} and drafted >= 4  # crops of 96+ px a side decode at 1/2 scale or less


def test_eval_transform_is_resize_shorter_side_then_center_crop():
    rng = np.random.default_rng(0)
    im = Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))
    data = encode(np.asarray(im))
    resized = np.asarray(im.resize((32, 24), Image.BILINEAR))[:, 4:28]  # shorter side 48 -> 24, central 24
    assert np.array_equal(tf.eval_image(data, 24, crop_fraction=1.0), resized)
    resized = np.asarray(im.resize((64, 48), Image.BILINEAR).crop((11, 3, 53, 45)))  # 48 -> 48, central 42
    assert np.array_equal(tf.eval_image(data, 42, crop_fraction=42 / 48), resized)
    assert np.array_equal(tf.eval_image(data, 24), tf.eval_image(data, 24))
