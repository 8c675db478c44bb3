"""Labelled image data (megatron_ext/data/images.py): sources, columns, load size, transforms, determinism across
meshes and resumes, bad images, errors, and the shipped shapes sample."""

import importlib.util
import io
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from support import REPO
from megatron_ext.data import image_transforms as tf
from megatron_ext.data.images import build_image_data
from megatron_ext.errors import ConfigError

SAMPLE = os.path.join(REPO, "examples", "data", "shapes_sample.parquet")
SHAPES = ["circle", "square", "triangle", "cross", "stripes"]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """Keep datasets' arrow caches of the temporary files out of the user's HF cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def encode(pixels, fmt="PNG"):
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def solid(i, label, size=(12, 10)):
    """A one-colour image whose colour names its sample (red) and its label (green): crops keep both."""
    return np.full((size[1], size[0], 3), (i % 256, 40 * label, 200), np.uint8)


def make_dataset(n=20, classes=3, size=(12, 10), image="image", label="label", label_feature="classlabel"):
    import datasets

    labels = [i % classes for i in range(n)]
    label_type = (datasets.ClassLabel(names=[f"c{k}" for k in range(classes)]) if label_feature == "classlabel"
                  else datasets.Value("int64"))
    features = datasets.Features({image: datasets.Image(), label: label_type})
    return datasets.Dataset.from_dict({image: [{"bytes": encode(solid(i, y, size)), "path": None}
                                               for i, y in enumerate(labels)], label: labels}, features=features)


def build(path, **kwargs):
    args = dict(image_size=8, global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=1, seed=1, num_workers=0)
    args.update(kwargs)
    return build_image_data(str(path), **args)


def pairs(batches):
    """(sample colour, label) per sample; asserts every pixel of a solid image agrees with its label."""
    out = []
    for batch in batches:
        pixels, labels = batch["pixels"], batch["labels"]
        assert pixels.dtype == torch.uint8 and labels.dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
        for image, label in zip(pixels, labels):
            assert (image[1] == 40 * label).all() and (image[2] == 200).all()
            out.append((int(image[0, 0, 0]), int(label)))
    return out


def steps(data, n):
    return [data.train_microbatches() for _ in range(n)]


def same(a, b):
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(u[k], v[k]) for u, v in zip(x, y) for k in ("pixels", "labels"))
        for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------------- shipped sample


def test_shipped_sample_loads_as_image_and_classlabel():
    import datasets

    ds = datasets.load_dataset("parquet", data_files=SAMPLE)["train"]
    assert isinstance(ds.features["image"], datasets.Image) and ds.features["label"].names == SHAPES
    assert np.bincount(ds["label"][:]).tolist() == [60] * 5 and os.path.getsize(SAMPLE) < 1 << 20
    data = build(SAMPLE, image_size=224, global_batch_size=16, micro_batch_size=4)
    assert (data.load_size, data.image_size, data.num_classes, data.class_names) == (32, 224, 5, SHAPES)
    assert (data.train_size, data.valid_size, data.num_skipped) == (270, 30, 0)
    batches = data.train_microbatches()
    assert [tuple(b["pixels"].shape) for b in batches] == [(4, 3, 32, 32)] * 4
    assert all(b["pixels"].dtype == torch.uint8 and b["loss_mask"].tolist() == [1.0] * 4 for b in batches)
    # validation sample k is row valid.rows[k] of the file, with its label, through the eval transform
    first = next(data.valid_microbatches(1))[0]
    rows = data.valid.rows[:4]
    ds = ds.cast_column("image", datasets.Image(decode=False))
    assert first["labels"].tolist() == [ds[int(r)]["label"] for r in rows]
    expected = np.stack([tf.eval_image(ds[int(r)]["image"], 32) for r in rows]).transpose(0, 3, 1, 2)
    assert torch.equal(first["pixels"], torch.from_numpy(expected))


def test_shipped_sample_equals_generator_output(tmp_path):
    import datasets

    spec = importlib.util.spec_from_file_location("make_image_sample", os.path.join(REPO, "tools",
                                                                                    "make_image_sample.py"))
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    fresh = tmp_path / "fresh.parquet"
    generator.write(str(fresh))
    shipped, regenerated = (datasets.load_dataset("parquet", data_files=str(p))["train"] for p in (SAMPLE, fresh))
    assert shipped.features == regenerated.features and shipped["label"][:] == regenerated["label"][:]
    rows = generator.make()
    for i in range(len(shipped)):
        assert np.array_equal(np.asarray(shipped[i]["image"]), rows["image"][i])
        assert np.array_equal(np.asarray(regenerated[i]["image"]), rows["image"][i])


# ----------------------------------------------------------------------------------------------- sources, columns


def test_parquet_file_glob_and_arrow(tmp_path):
    ds = make_dataset(40)
    ds.select(range(20)).to_parquet(str(tmp_path / "part-0.parquet"))
    ds.select(range(20, 40)).to_parquet(str(tmp_path / "part-1.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next(str(p) for p in (tmp_path / "saved").glob("*.arrow"))
    for path, total in ((tmp_path / "part-0.parquet", 20), (tmp_path / "part-*.parquet", 40), (arrow, 40)):
        data = build(path, data_split="3,1")
        assert (data.train_size + data.valid_size, data.num_classes, data.class_names) == (total, 3, ["c0", "c1", "c2"])
        assert data.valid_size == total // 4
        seen = pairs(sum(steps(data, data.train_size // 4), []))
        assert len(set(seen)) == len(seen) == data.train_size - data.train_size % 4  # one epoch: each once
        assert all(label == colour % 3 for colour, label in seen)


def test_save_to_disk_uses_its_test_split(tmp_path):
    import datasets

    datasets.DatasetDict(train=make_dataset(16), test=make_dataset(6)).save_to_disk(str(tmp_path / "dd"))
    data = build(tmp_path / "dd")
    assert (data.train_size, data.valid_size) == (16, 6)
    valid = pairs(sum(data.valid_microbatches(2), []))  # 8 samples of 6: wraps
    assert [colour for colour, _ in valid] == [0, 1, 2, 3, 4, 5, 0, 1]


def test_imagefolder_with_and_without_split_folders(tmp_path):
    for split, n in (("train", 6), ("test", 2)):
        for label, name in enumerate(["cat", "dog"]):
            os.makedirs(tmp_path / "split" / split / name)
            for i in range(n):
                Image.fromarray(solid(10 * label + i, label)).save(tmp_path / "split" / split / name / f"{i}.png")
            os.makedirs(tmp_path / "flat" / name, exist_ok=True)
            for i in range(n):
                Image.fromarray(solid(10 * label + i, label)).save(tmp_path / "flat" / name / f"{split}{i}.jpg",
                                                                   quality=100)
    data = build(tmp_path / "split")
    assert (data.train_size, data.valid_size, data.class_names) == (12, 4, ["cat", "dog"])
    assert sorted(pairs(sum(steps(data, 3), []))) == [(10 * y + i, y) for y in (0, 1) for i in range(6)]
    data = build(tmp_path / "flat", data_split="12,4")
    assert (data.train_size, data.valid_size, data.class_names) == (12, 4, ["cat", "dog"])


def test_column_detection_and_explicit_columns(tmp_path):
    import datasets

    cifar = make_dataset(12, image="img", label="fine_label")  # plus a second ClassLabel, as CIFAR-100 has
    cifar = cifar.add_column("coarse_label", [0] * 12).cast_column("coarse_label", datasets.ClassLabel(names=["x"]))
    cifar.save_to_disk(str(tmp_path / "cifar"))
    assert build(tmp_path / "cifar").num_classes == 3
    assert build(tmp_path / "cifar", label_column="coarse_label").class_names == ["x"]
    only_classlabel = make_dataset(12, image="picture", label="category")
    only_classlabel.save_to_disk(str(tmp_path / "only"))
    assert build(tmp_path / "only").class_names == ["c0", "c1", "c2"]
    plain = make_dataset(12, image="picture", label="target", label_feature="int")
    plain.save_to_disk(str(tmp_path / "plain"))
    with pytest.raises(ConfigError, match="cannot tell which column holds the labels .*pass --label-column"):
        build(tmp_path / "plain")
    data = build(tmp_path / "plain", label_column="target")
    assert (data.num_classes, data.class_names) == (3, None)
    with pytest.raises(ConfigError, match=r"--image-column photo: no such column .*\(columns: picture, target\)"):
        build(tmp_path / "plain", image_column="photo", label_column="target")


def test_small_images_load_at_native_size(tmp_path):
    make_dataset(12, size=(32, 32)).save_to_disk(str(tmp_path / "cifar_like"))
    data = build(tmp_path / "cifar_like", image_size=224)
    assert data.load_size == 32 and data.train_microbatches()[0]["pixels"].shape == (2, 3, 32, 32)
    make_dataset(12, size=(64, 48)).save_to_disk(str(tmp_path / "large"))
    data = build(tmp_path / "large", image_size=24)
    assert data.load_size == 24 and next(data.valid_microbatches(1))[0]["pixels"].shape[1:] == (3, 24, 24)


# ----------------------------------------------------------------------------------------------- transforms


# ----------------------------------------------------------------------------------------------- batches


def test_same_seed_same_batches_on_any_mesh_and_worker_count():
    kwargs = dict(image_size=32, global_batch_size=8, micro_batch_size=2)
    one = build(SAMPLE, num_workers=0, **kwargs)
    reference = steps(one, 3)
    assert same(reference, steps(build(SAMPLE, num_workers=2, **kwargs), 3))
    assert not same(reference, steps(build(SAMPLE, seed=2, **kwargs), 3))
    ranks = [steps(build(SAMPLE, dp_rank=r, dp_size=2, **kwargs), 3) for r in (0, 1)]
    for step in range(3):
        assert len(ranks[0][step]) == len(ranks[1][step]) == 2
        assert same([ranks[0][step] + ranks[1][step]], [reference[step]])
    assert same(list(one.valid_microbatches(2)), list(build(SAMPLE, dp_size=1, num_workers=2, **kwargs)
                                                      .valid_microbatches(2)))
    assert same(list(one.valid_microbatches(3)), list(one.valid_microbatches(3)))
    # a sample's augmentation is a function of (seed, epoch, sample index) only
    image = [one.train[(5, 0)][0], one.train[(5, 1)][0], one.train[(6, 0)][0], build(SAMPLE, seed=2).train[(5, 0)][0]]
    assert np.array_equal(image[0], one.train[(5, 0)][0])
    assert not any(np.array_equal(image[0], other) for other in image[1:])


def test_resume_matches_an_uninterrupted_run_with_prefetching_workers():
    kwargs = dict(image_size=32, global_batch_size=64, micro_batch_size=16, num_workers=2, prefetch_factor=4)
    straight = build(SAMPLE, **kwargs)  # 270 train samples: 4 steps an epoch, so step 5 starts epoch 1
    first = steps(straight, 3)
    state = straight.state_dict()
    assert state == {"consumed_samples": 3 * 64}  # the workers are further ahead, the state is not
    rest = steps(straight, 3)
    resumed = build(SAMPLE, **kwargs)
    resumed.load_state_dict(state)
    assert same(steps(resumed, 3), rest)
    resumed.load_state_dict({"consumed_samples": 0})  # same object, rewound: workers are reset, not stale
    assert same(steps(resumed, 3), first)
    straight.close()
    resumed.close()


# ----------------------------------------------------------------------------------------------- bad data, errors


def test_bad_images_are_skipped_and_counted(tmp_path, capsys):
    import datasets

    ds = make_dataset(20, label_feature="int")
    values = [{"bytes": encode(solid(i, i % 3)), "path": None} for i in range(20)]
    values[3] = {"bytes": b"not an image", "path": "photo3.png"}
    values[5] = {"bytes": encode(solid(5, 2))[:40], "path": None}  # PNG with its data cut off
    labels = [i % 3 for i in range(20)]
    labels[7], labels[9] = None, -4
    ds = datasets.Dataset.from_dict({"image": values, "label": labels}, features=ds.features)
    ds.to_parquet(str(tmp_path / "bad.parquet"))
    data = build(tmp_path / "bad.parquet", data_split="1,0")
    assert (data.num_skipped, data.train_size, data.valid_size) == (4, 16, 0)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("skipped 4 bad images (first: train row 3 (photo3.png): unreadable "
                                               "image (cannot identify image file")
    assert sorted(r.split(":")[0] for r in data.skipped) == ["train row 3 (photo3.png)", "train row 5", "train row 7",
                                                            "train row 9"]
    assert any("missing label" in r for r in data.skipped) and any("negative label -4" in r for r in data.skipped)
    colours = {colour for colour, _ in pairs(sum(steps(data, 4), []))}
    assert colours == set(range(20)) - {3, 5, 7, 9}
    with pytest.raises(ConfigError) as error:
        build(tmp_path / "bad.parquet", bad_images="error")
    message = str(error.value)
    assert message.startswith(f"--data-path {tmp_path / 'bad.parquet'}: bad image at train row 3 (photo3.png): ")
    assert message.endswith("pass --bad-images skip") and "\n" not in message


def test_bad_file_in_imagefolder_is_named(tmp_path, capsys):
    for label in range(2):
        os.makedirs(tmp_path / "imgs" / f"class{label}")
        for i in range(4):
            Image.fromarray(solid(i, label)).save(tmp_path / "imgs" / f"class{label}" / f"{i}.png")
    (tmp_path / "imgs" / "class1" / "broken.jpg").write_bytes(b"\xff\xd8 garbage")
    data = build(tmp_path / "imgs", data_split="1,0")
    assert data.num_skipped == 1 and data.train_size == 8
    broken = str(tmp_path / "imgs" / "class1" / "broken.jpg")
    assert capsys.readouterr().out.startswith(f"skipped 1 bad images (first: {broken}: unreadable image")
    with pytest.raises(ConfigError, match=f"bad image at {broken}: unreadable image"):
        build(tmp_path / "imgs", bad_images="error")


def test_decode_failure_in_a_worker_substitutes_and_counts(tmp_path, capsys):
    import datasets

    ds = make_dataset(8, size=(16, 16))
    values = [{"bytes": encode(solid(i, i % 3, (16, 16)), "JPEG"), "path": None} for i in range(8)]
    noisy = encode(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8), "JPEG")
    values[2]["bytes"] = noisy[:len(noisy) // 2]  # header intact, scan data cut: passes the build-time check
    datasets.Dataset.from_dict({"image": values, "label": ds["label"][:]}, features=ds.features).to_parquet(
        str(tmp_path / "t.parquet"))
    for workers in (0, 2):
        data = build(tmp_path / "t.parquet", data_split="1,0", global_batch_size=8, micro_batch_size=4,
                     num_workers=workers)
        batches = data.train_microbatches()
        assert data.num_skipped == 0 and data.decode_failures == 1
        assert "replacing images that fail to decode by other samples (first: train row 2: image file is truncated" \
            in capsys.readouterr().out
        # labels 0,1,2,0,1,2,0,1: sample 2 is replaced by sample (2 + 7919) % 8 = 1, so one 2 becomes a 1
        labels = torch.cat([b["labels"] for b in batches])
        assert torch.bincount(labels).tolist() == [3, 4, 1]
        data.close()


def test_num_classes_and_path_errors(tmp_path):
    make_dataset(12, classes=5).to_parquet(str(tmp_path / "five.parquet"))
    assert build(tmp_path / "five.parquet", num_classes=5).num_classes == 5
    assert build(tmp_path / "five.parquet", num_classes=8).num_classes == 5
    with pytest.raises(ConfigError, match=r"^--num-classes 3: the data has labels up to 4 \(5 classes\); "
                                          r"pass --num-classes 5$"):
        build(tmp_path / "five.parquet", num_classes=3)
    (tmp_path / "table.csv").write_text("a,b\n")
    os.makedirs(tmp_path / "empty")
    for path, reason in ((tmp_path / "missing.parquet", "no such file"), (tmp_path / "nothing" / "here", "no such"),
                         (tmp_path / "table.csv", "unsupported file type .csv"),
                         (tmp_path / "empty", "a directory with neither")):
        with pytest.raises(ConfigError) as error:
            build(path)
        message = str(error.value)
        assert message.startswith(f"--data-path {path}: {reason}") and "\n" not in message
        assert "hub id" in message


def test_unknown_hub_id_offline(tmp_path):
    """In a subprocess: huggingface_hub reads HF_HUB_OFFLINE once, at import."""
    script = """
from megatron_ext.data.images import build_image_data
from megatron_ext.errors import ConfigError
try:
    build_image_data("no-such-owner/no-such-images", image_size=8, global_batch_size=4, micro_batch_size=2,
                     dp_rank=0, dp_size=1, seed=0)
except ConfigError as e:
    print(e)
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"))
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "--data-path no-such-owner/no-such-images: cannot load it as a datasets hub id")


def test_tensor_parallel_broadcast_reads_on_one_rank_only(single_rank):
    """The TP ranks that do not read never touch the source's loader: they receive the reader's batches (here a
    world of one, so the "receiver" gets its own empty buffers back, shaped as the spec says)."""
    import torch.distributed as dist

    from megatron_ext.data.sources import TensorParallelBroadcast

    class Unread:
        valid_size, num_classes = 4, 5

        def train_microbatches(self):
            raise AssertionError("a receiving rank decoded images")

        valid_microbatches = train_microbatches

    spec = dict(pixels=((2, 3, 8, 8), torch.uint8), labels=((2,), torch.int64))
    wrapped = TensorParallelBroadcast(Unread(), spec, 3, device=torch.device("cpu"), group=dist.group.WORLD, src=0,
                                      reader=False)
    batches = wrapped.train_microbatches()
    assert len(batches) == 3 and all(b["pixels"].shape == (2, 3, 8, 8) and b["labels"].dtype == torch.int64
                                     for b in batches)
    assert len(list(wrapped.valid_microbatches(2))) == 2 and wrapped.num_classes == 5
