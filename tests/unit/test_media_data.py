"""Rows with media: loading from JSONL and Parquet, every refusal of untrusted media, and the digits dataset."""

from __future__ import annotations

import base64
import importlib
import io
import json
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from rlx.config import MEDIA_MODALITIES, ConfigError, DataConfig, MediaLimits, load_config
from rlx.data import load_splits
from rlx.data.digits import PROMPT, digits_splits
from rlx.data.files import load_rows
from rlx.errors import DataError
from rlx.media.loading import LOADERS, MediaItem, load_image

KEYS = ("prompt", "label", "metadata")
IMAGES = {"image": "images"}


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def gradient(width: int = 5, height: int = 4) -> Image.Image:
    """An RGB image whose every pixel differs, so a flip or a channel swap shows."""
    pixels = np.arange(height * width * 3, dtype=np.uint8).reshape(height, width, 3) * 3
    return Image.fromarray(pixels, "RGB")


def claims_size(width: int, height: int) -> bytes:
    """A real 1x1 PNG whose header (IHDR, CRC fixed) claims width x height: a decompression bomb's header."""
    real = png_bytes(Image.new("L", (1, 1)))
    chunk = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    ihdr = struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))
    return real[:8] + ihdr + real[8 + len(ihdr):]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def write_parquet(path, records):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def limits(tmp_path, **kwargs) -> MediaLimits:
    return MediaLimits(root=str(tmp_path), **kwargs)


# ------------------------------------------------------------------------------------------ loading rows


def test_jsonl_rows_with_a_path_base64_bytes_and_an_array(tmp_path):
    image = gradient()
    (tmp_path / "pics").mkdir()
    image.save(tmp_path / "pics" / "a.png")
    grey = [[0, 128, 255], [255, 128, 0]]
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"prompt": "<image> What is shown?", "label": "a", "images": ["pics/a.png"]},
        {"prompt": "Compare <image> and <image>.", "label": "b",
         "images": [{"bytes": base64.b64encode(png_bytes(image)).decode()}, "pics/a.png"]},
        {"prompt": [{"role": "user", "content": "<image>"}], "label": "c", "images": [grey]},
        {"prompt": "text only", "label": "d"},
    ])
    rows = load_rows(path, "jsonl", *KEYS, IMAGES, limits(tmp_path))
    lim = limits(tmp_path)
    first, second, third, fourth = rows
    assert first.media["image"][0].path == str(tmp_path / "pics" / "a.png")  # resolved from the file's folder
    assert [item.path is None for item in second.media["image"]] == [True, False]
    expected = np.asarray(image)
    for item in (*first.media["image"], *second.media["image"]):
        assert np.array_equal(load_image(item, lim, first.source), expected)
    decoded = load_image(third.media["image"][0], lim, third.source)
    assert decoded.dtype == np.uint8 and decoded.shape == (2, 3, 3)
    assert np.array_equal(decoded[:, :, 1], np.array(grey, dtype=np.uint8))
    assert fourth.media == {} and first.source == f"{path}:1"


def test_parquet_rows_with_binary_and_array(tmp_path):
    image = gradient()
    floats = np.linspace(0, 1, 12).reshape(2, 2, 3).tolist()  # float RGB in [0, 1]
    lim = limits(tmp_path)
    binary_file = write_parquet(tmp_path / "binary.parquet", [
        {"prompt": "<image>", "label": "1", "images": [png_bytes(image)]},
        {"prompt": "<image> <image>", "label": "2", "images": [png_bytes(image), png_bytes(gradient(2, 2))]},
    ])
    one, two = load_rows(binary_file, "parquet", *KEYS, IMAGES, lim)
    assert isinstance(one.media["image"][0].data, bytes) and len(two.media["image"]) == 2
    assert np.array_equal(load_image(one.media["image"][0], lim, one.source), np.asarray(image))
    assert load_image(two.media["image"][1], lim, two.source).shape == (2, 2, 3)
    array_file = write_parquet(tmp_path / "arrays.parquet", [
        {"prompt": "<image>", "label": "1", "pixels": [floats]},
        {"prompt": "no image", "label": "2", "pixels": None},
    ])
    with_array, without = load_rows(array_file, "parquet", *KEYS, {"image": "pixels"}, lim)
    pixels = load_image(with_array.media["image"][0], lim, with_array.source)
    assert pixels.dtype == np.uint8 and pixels.shape == (2, 2, 3)
    assert pixels[0, 0, 0] == 0 and pixels[1, 1, 2] == 255  # 0.0 -> 0, 1.0 -> 255
    assert without.media == {}


def test_load_image_converts_modes_and_arrays_to_rgb():
    lim = MediaLimits()
    rgba = Image.fromarray(np.full((2, 2, 4), [10, 20, 30, 0], dtype=np.uint8), "RGBA")
    assert load_image(MediaItem("image", data=png_bytes(rgba)), lim, "x").tolist() == [[[10, 20, 30]] * 2] * 2
    grey = Image.fromarray(np.array([[7, 200]], dtype=np.uint8), "L")
    assert load_image(MediaItem("image", data=png_bytes(grey)), lim, "x").tolist() == [[[7] * 3, [200] * 3]]
    palette = Image.new("P", (1, 1))
    palette.putpalette([9, 8, 7] * 256)
    assert load_image(MediaItem("image", data=png_bytes(palette)), lim, "x").tolist() == [[[9, 8, 7]]]
    # the array rule: uint8 as is, other integers up to 16 on the digits' 0..16 scale, floats in [0, 1]
    assert load_image(MediaItem("image", array=np.array([[16]], dtype=np.uint8)), lim, "x").max() == 16
    assert load_image(MediaItem("image", array=np.array([[0, 8, 16]])), lim, "x")[0, :, 0].tolist() == [0, 128, 255]
    assert load_image(MediaItem("image", array=np.array([[0, 17]])), lim, "x")[0, :, 0].tolist() == [0, 17]
    assert load_image(MediaItem("image", array=np.array([[0.5]])), lim, "x").tolist() == [[[128] * 3]]
    for bad, match in ((np.array([[300]]), "0..255"), (np.array([[1.5]]), r"\[0, 1\]"), (np.zeros(4), "shape")):
        with pytest.raises(DataError, match=match):
            load_image(MediaItem("image", array=bad), lim, "row 9")


def test_media_item_holds_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one"):
        MediaItem("image", path="a.png", data=b"x")
    with pytest.raises(ValueError, match="exactly one"):
        MediaItem("image")
    with pytest.raises(ValueError, match="kind"):
        MediaItem("picture", path="a.png")


def test_every_modality_the_config_accepts_has_a_loader():
    """The modalities are declared once, in the config; a new one is refused by the loaders' own error
    paths (`LOADERS[item.kind]`) until it has a loader, and a renamed loader breaks the name errors give."""
    for kind in MEDIA_MODALITIES:
        DataConfig(media_keys={kind: "files"})  # the config takes it
        MediaItem(kind, path="a")  # and so does a row's media item
    assert set(LOADERS) == set(MEDIA_MODALITIES)
    for kind, name in LOADERS.items():
        module, _, function = name.rpartition(".")
        assert callable(getattr(importlib.import_module(module), function)), f"LOADERS[{kind!r}] = {name}"


# ------------------------------------------------------------------------------------------ refusals


def test_decompression_bomb_header_is_refused_before_decoding(tmp_path):
    lim = limits(tmp_path)
    for width in (5000, 100_000):  # over max_pixels; the second over Pillow's own bomb limit as well
        (tmp_path / "bomb.png").write_bytes(claims_size(width, width))
        path = write_jsonl(tmp_path / "bomb.jsonl", [{"prompt": "<image>", "label": "x", "images": ["bomb.png"]}])
        row, = load_rows(path, "jsonl", *KEYS, IMAGES, lim)  # small on disk: loads, it is never decoded here
        with pytest.raises(DataError, match=rf"{path}:1: .*data\.media_limits\.max_pixels=16777216"):
            load_image(row.media["image"][0], lim, row.source)


def test_pixel_and_byte_limits_name_their_fields(tmp_path):
    data = png_bytes(gradient(5, 4))
    with pytest.raises(DataError, match=r"f\.jsonl:2: image of 5x4 = 20 pixels .* data\.media_limits\.max_pixels=19"):
        load_image(MediaItem("image", data=data), limits(tmp_path, max_pixels=19), "f.jsonl:2")
    assert load_image(MediaItem("image", data=data), limits(tmp_path, max_pixels=20), "f.jsonl:2").shape == (4, 5, 3)
    with pytest.raises(DataError, match=rf"f\.jsonl:2: .*{len(data)} bytes.*data\.media_limits\.max_bytes=10;"):
        load_image(MediaItem("image", data=data), limits(tmp_path, max_bytes=10), "f.jsonl:2")
    with pytest.raises(DataError, match="max_pixels=3"):
        load_image(MediaItem("image", array=np.zeros((2, 2), dtype=np.uint8)), limits(tmp_path, max_pixels=3), "x")
    (tmp_path / "big.png").write_bytes(data)
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"prompt": "<image>", "label": "1", "images": ["big.png"]},
        {"prompt": "<image>", "label": "2", "images": [{"bytes": base64.b64encode(data).decode()}]},
    ])
    with pytest.raises(DataError, match=r"2 malformed row\(s\)(.|\n)*rows\.jsonl:1(.|\n)*max_bytes=10(.|\n)*"
                                        r"rows\.jsonl:2: images\[0\](.|\n)*max_bytes=10"):
        load_rows(path, "jsonl", *KEYS, IMAGES, limits(tmp_path, max_bytes=10))


def test_undecodable_files_are_data_errors(tmp_path):
    lim = limits(tmp_path)
    truncated = png_bytes(gradient(40, 40))[:80]
    with pytest.raises(DataError, match="row 3: inline image is corrupt"):
        load_image(MediaItem("image", data=truncated), lim, "row 3")
    (tmp_path / "notes.png").write_text("not an image at all")
    with pytest.raises(DataError, match=r"row 3: image file .*notes\.png is not an image rlx decodes \(PNG"):
        load_image(MediaItem("image", path=str(tmp_path / "notes.png")), lim, "row 3")
    with pytest.raises(DataError, match="only images"):
        load_image(MediaItem("audio", data=b"RIFF"), lim, "row 3")


def test_paths_outside_the_root_are_refused(tmp_path):
    root, outside = tmp_path / "data", tmp_path / "secret"
    root.mkdir(), outside.mkdir()
    gradient().save(outside / "x.png")
    (root / "link.png").symlink_to(outside / "x.png")
    (root / "ok.png").write_bytes(png_bytes(gradient()))
    lim = MediaLimits(root=str(root))
    path = write_jsonl(root / "rows.jsonl", [
        {"prompt": "<image>", "label": "1", "images": ["../secret/x.png"]},
        {"prompt": "<image>", "label": "2", "images": ["link.png"]},
        {"prompt": "<image>", "label": "3", "images": [str(outside / "x.png")]},
        {"prompt": "<image>", "label": "4", "images": ["missing.png"]},
        {"prompt": "<image>", "label": "5", "images": ["ok.png"]},
    ])
    with pytest.raises(DataError) as caught:
        load_rows(path, "jsonl", *KEYS, IMAGES, lim)
    message = str(caught.value)
    assert "4 malformed row(s)" in message and "rows.jsonl:5" not in message
    for line in (1, 2, 3):
        assert f"rows.jsonl:{line}: images[0]: media path" in message
    assert message.count(f"outside the media root {root}; move the file under it or set data.media_limits.root") == 3
    assert f"rows.jsonl:4: images[0]: media file '{root / 'missing.png'}' does not exist" in message
    # load_image checks again: an item made (or a file swapped) after loading is refused the same way
    with pytest.raises(DataError, match="row 7: media path .* outside the media root"):
        load_image(MediaItem("image", path=str(root / "link.png")), lim, "row 7")
    assert load_image(MediaItem("image", path=str(root / "ok.png")), lim, "row 7").shape == (4, 5, 3)


def test_the_root_defaults_to_the_data_files_folder(tmp_path):
    (tmp_path / "set").mkdir()
    gradient().save(tmp_path / "outside.png")
    gradient().save(tmp_path / "set" / "inside.png")
    rows = [{"prompt": "<image>", "label": "1", "images": ["inside.png"]}]
    train = write_jsonl(tmp_path / "set" / "train.jsonl", rows)
    config = DataConfig(source="jsonl", path=str(train), media_keys=IMAGES, eval_size=0)
    assert config.media_limits.root is None and config.media_limits.root_dir == tmp_path / "set"
    row, = load_splits(config)[0]
    assert load_image(row.media["image"][0], config.media_limits, row.source).shape == (4, 5, 3)
    write_jsonl(train, [{"prompt": "<image>", "label": "1", "images": ["../outside.png"]}])
    with pytest.raises(DataError, match="outside the media root"):
        load_splits(config)


def test_placeholders_must_match_the_media(tmp_path):
    gradient().save(tmp_path / "a.png")
    chat = [{"role": "system", "content": "look"}, {"role": "user", "content": "<image> then <image>"}]
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"prompt": "no placeholder", "label": "1", "images": ["a.png"]},
        {"prompt": "<image><image>", "label": "2", "images": ["a.png"]},
        {"prompt": "<image>", "label": "3"},
        {"prompt": chat, "label": "4", "images": ["a.png"]},
        {"prompt": "<image> and <video>", "label": "5", "images": ["a.png"]},
        {"prompt": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "<image>"}],
         "label": "6", "images": ["a.png", "a.png"]},
    ])
    with pytest.raises(DataError) as caught:
        load_rows(path, "jsonl", *KEYS, IMAGES, limits(tmp_path))
    message = str(caught.value)
    assert "5 malformed row(s)" in message and "rows.jsonl:6" not in message  # placeholders count across messages
    assert "rows.jsonl:1: 0 <image> placeholder(s) in the prompt but 1 image item(s) in field 'images'" in message
    assert "rows.jsonl:2: 2 <image> placeholder(s) in the prompt but 1 image item(s)" in message
    assert "rows.jsonl:3: 1 <image> placeholder(s) in the prompt but 0 image item(s)" in message
    assert "rows.jsonl:4: 2 <image> placeholder(s) in the prompt but 1 image item(s)" in message
    assert "rows.jsonl:5: 1 <video> placeholder(s) in the prompt but 0 video item(s) in no field " \
           "(set data.media_keys.video)" in message
    # without media_keys rows are text-only: placeholders are text like any other
    assert [row.media for row in load_rows(path, "jsonl", *KEYS)] == [{}] * 6


def test_bad_media_values_are_reported(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"prompt": "<image>", "label": "1", "images": [{"bytes": "@@not base64@@"}]},
        {"prompt": "<image>", "label": "2", "images": [[[1, 2], [3]]]},
        {"prompt": "<image>", "label": "3", "images": [[1, 2, 3]]},
        {"prompt": "<image>", "label": "4", "images": [42]},
        {"prompt": "<image>", "label": "5", "images": [{"url": "http://x"}]},
    ])
    with pytest.raises(DataError) as caught:
        load_rows(path, "jsonl", *KEYS, IMAGES, limits(tmp_path))
    message = str(caught.value)
    for line, reason in ((1, "not valid base64"), (2, "unequal lengths"), (3, "must have shape [H, W]"),
                         (4, "got int"), (5, "got keys ['url']")):
        assert f"rows.jsonl:{line}: images[0]: " in message and reason in message


def test_media_config_fields():
    config = load_config(None, ["data.media_keys={image: pics}", "data.media_limits.max_pixels=100"])
    assert config.data.media_keys == {"image": "pics"} and config.data.media_limits.max_pixels == 100
    with pytest.raises(ConfigError, match="'picture' is not a modality; use image, audio, video"):
        load_config(None, ["data.media_keys={picture: pics}"])
    with pytest.raises(ConfigError, match="Did you mean 'data.media_limits.max_bytes'"):
        load_config(None, ["data.media_limits.max_byte=1"])


# ------------------------------------------------------------------------------------------ digits


def test_digits_splits_are_disjoint_deterministic_and_sized():
    train, held_out = digits_splits(train_size=5000, eval_size=500, seed=0)
    assert (len(train), len(held_out)) == (1297, 500)
    train_ids = {row.metadata["index"] for row in train}
    held_ids = {row.metadata["index"] for row in held_out}
    assert not train_ids & held_ids and len(train_ids | held_ids) == 1797
    again, again_held = digits_splits(5000, 500, 0)
    assert [r.metadata["index"] for r in again] == [r.metadata["index"] for r in train]
    assert [r.metadata["index"] for r in again_held] == [r.metadata["index"] for r in held_out]
    other, _ = digits_splits(5000, 500, 1)
    assert [r.metadata["index"] for r in other] != [r.metadata["index"] for r in train]
    capped, small_eval = digits_splits(train_size=100, eval_size=50, seed=0)
    assert len(capped) == 100  # a smaller eval split is a prefix of a larger one:
    assert [r.metadata["index"] for r in small_eval] == [r.metadata["index"] for r in held_out][:50]
    with pytest.raises(DataError, match="data.eval_size=598 .* set data.eval_size<=597"):
        digits_splits(5000, 598, 0)


def test_digits_rows_show_their_labels():
    train, held_out = digits_splits(5000, 500, seed=0)
    rows = {row.metadata["index"]: row for row in train + held_out}
    zero = rows[0]  # scikit-learn's first image is a 0; its top row of ink is 0 0 5 13 9 1 0 0 (of 16)
    assert zero.label == "0" and zero.prompt == PROMPT and zero.prompt.count("<image>") == 1
    pixels = load_image(zero.media["image"][0], MediaLimits(), zero.source)
    assert pixels.shape == (8, 8, 3) and pixels.dtype == np.uint8
    assert pixels[0, :, 0].tolist() == [0, 0, 80, 207, 143, 16, 0, 0]  # v * 255 / 16, rounded
    one = load_image(rows[1].media["image"][0], MediaLimits(), rows[1].source)  # a 1, inked up to 16
    assert rows[1].label == "1" and one.shape == (8, 8, 3) and one.dtype == np.uint8 and one.max() == 255
    assert (pixels[:, :, 0] == pixels[:, :, 2]).all()
    from sklearn.datasets import load_digits

    digits = load_digits()
    for index in (1, 17, 1796):
        assert rows[index].label == str(digits.target[index])
        ink = load_image(rows[index].media["image"][0], MediaLimits(), "x")[:, :, 0]
        assert np.array_equal(ink, np.rint(digits.images[index] * 255 / 16))
    assert sorted({row.label for row in held_out}) == [str(d) for d in range(10)]
    with pytest.raises(ValueError):  # rows are shared across groups: their pixels cannot change
        zero.media["image"][0].array[0, 0, 0] = 1


def test_digits_source_through_the_config():
    config = load_config(None, ["data.source=digits", "data.train_size=64"]).data
    assert config.eval_size == 500  # the digits' own default: 500 unseen images
    train, held_out = load_splits(config)
    assert (len(train), len(held_out)) == (64, 500)
    with pytest.raises(DataError, match="data.eval_size=600"):
        load_splits(DataConfig(source="digits", eval_size=600))
    assert DataConfig().eval_size == 128  # other sources keep theirs
