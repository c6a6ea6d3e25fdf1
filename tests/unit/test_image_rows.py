"""Rows with images (`posttrain.data.images`): each format users bring (TRL's images column,
OpenAI / NeMo-RL content parts, data urls, paths relative to the data file, PIL images,
`datasets.Image` features) becomes the same messages and images; a bad image or a count that does
not match is one line naming the row; the rows feed the tiny-vl processor."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from posttrain.data.datasets import load_image_jsonl
from posttrain.data.images import image_row, image_rows, load_image
from posttrain.errors import DataError

EXPECTED = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]


def png(color: str, size: tuple[int, int] = (8, 6)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def pixel(image: Image.Image) -> tuple[int, int, int]:
    assert image.mode == "RGB"
    return image.getpixel((0, 0))


@pytest.fixture
def data_dir(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(png("red"))
    (tmp_path / "img" / "blue.png").write_bytes(png("blue"))
    (tmp_path / "img" / "bad.png").write_bytes(b"\x89PNG not really")
    return tmp_path


def test_trl_rows_take_the_images_column_in_order():
    row = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
           "images": [Image.new("RGBA", (4, 4), "red")], "answer": "red"}
    out = image_row(row, "row 0")
    assert out["messages"] == EXPECTED and out["answer"] == "red" and set(out) == {"messages", "images", "answer"}
    assert [pixel(i) for i in out["images"]] == [(255, 0, 0)]  # RGBA made RGB
    two = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "vs"}, {"type": "image"}]}],
           "images": [Image.new("RGB", (2, 2), "red"), Image.new("RGB", (2, 2), "blue")]}
    assert [pixel(i) for i in image_row(two, "row 1")["images"]] == [(255, 0, 0), (0, 0, 255)]
    plain = image_row({"prompt": "What colour?", "image": Image.new("RGB", (2, 2), "blue")}, "row 2")
    assert plain["messages"] == EXPECTED and [pixel(i) for i in plain["images"]] == [(0, 0, 255)]  # image first


def test_openai_and_nemo_rl_content_parts_carry_their_images(data_dir):
    url = "data:image/png;base64," + base64.b64encode(png("blue")).decode()
    openai = {"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                        {"type": "text", "text": "and"},
                                                        {"type": "image_url", "image_url": "img/red.png"}]}]}
    out = image_row(openai, "row 0", base_dir=data_dir)
    assert out["messages"] == [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                               {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    assert [pixel(i) for i in out["images"]] == [(0, 0, 255), (255, 0, 0)]
    nemo = {"prompt": [{"role": "user", "content": [{"type": "image", "image": str(data_dir / "img" / "red.png")},
                                                    {"type": "image", "image": Image.new("RGB", (3, 3), "blue")},
                                                    {"type": "image"}, {"type": "text", "text": "?"}]}],
            "images": [{"bytes": png("white"), "path": None}]}  # inline ones and a bare one from the column
    assert [pixel(i) for i in image_row(nemo, "row 1")["images"]] == [(255, 0, 0), (0, 0, 255), (255, 255, 255)]


def test_a_jsonl_file_resolves_paths_from_its_directory_and_names_lines(data_dir, monkeypatch):
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
             "images": ["img/red.png"], "answer": "red"},
            {"prompt": [{"role": "user", "content": [{"type": "image", "image": "file://img/blue.png"},
                                                     {"type": "text", "text": "What colour?"}]}], "answer": "blue"}]
    path = data_dir / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.chdir(data_dir / "img")  # not the working directory: the file's
    out = load_image_jsonl(path)
    assert [r["messages"] for r in out] == [EXPECTED, EXPECTED] and [r["answer"] for r in out] == ["red", "blue"]
    assert [pixel(r["images"][0]) for r in out] == [(255, 0, 0), (0, 0, 255)]
    rows[1]["prompt"][0]["content"][0]["image"] = "img/missing.png"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DataError) as e:
        load_image_jsonl(path)
    assert str(e.value) == f"{path}:2: message 0 part 0 'img/missing.png': no such file"


def test_datasets_image_features_load_decoded_or_not(data_dir):
    import datasets

    features = datasets.Features({"question": datasets.Value("string"), "images": datasets.Sequence(datasets.Image())})
    table = {"question": ["What colour?", "What colour?"],
             "images": [[str(data_dir / "img" / "red.png")], [{"bytes": png("blue"), "path": None}]]}
    dataset = datasets.Dataset.from_dict(table, features=features).rename_column("question", "prompt")
    decoded = image_rows(dataset)  # rows hold PIL images
    assert [r["messages"] for r in decoded] == [EXPECTED, EXPECTED]
    assert [pixel(r["images"][0]) for r in decoded] == [(255, 0, 0), (0, 0, 255)]
    raw = image_rows(dataset.cast_column("images", datasets.Sequence(datasets.Image(decode=False))))  # {bytes, path}
    assert [pixel(r["images"][0]) for r in raw] == [(255, 0, 0), (0, 0, 255)]


def one_line_error(row: dict, **options) -> str:
    with pytest.raises(DataError) as e:
        image_rows([{"prompt": "q", "images": [Image.new("RGB", (1, 1))]}, row], ["t.jsonl:1", "t.jsonl:7"], **options)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_images_are_one_line_naming_the_row_and_the_image(data_dir):
    column = lambda *images: {"prompt": [{"role": "user", "content": [{"type": "image"}] * len(images)}], "images": list(images)}  # noqa: E731
    assert one_line_error(column(str(data_dir / "img" / "none.png"))).startswith(
        "t.jsonl:7: images[0] '") and one_line_error(column(str(data_dir / "img" / "none.png"))).endswith("none.png': no such file")
    assert one_line_error(column("img/bad.png"), base_dir=data_dir) == \
        "t.jsonl:7: images[0] 'img/bad.png': not a readable image (UnidentifiedImageError)"
    assert one_line_error(column(b"GIF89a\x00")) == "t.jsonl:7: images[0]: not a readable image (UnidentifiedImageError)"
    assert one_line_error(column(png("red"), {"bytes": png("red", (40, 30))}), max_pixels=1000) == \
        "t.jsonl:7: images[1]: 40x30 is 1200 pixels, over the limit of 1000 (max_pixels)"
    noisy = io.BytesIO()
    Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48).save(noisy, format="PNG")
    truncated = noisy.getvalue()[: len(noisy.getvalue()) // 2]  # a valid header, half the pixels
    assert one_line_error(column(truncated)).startswith("t.jsonl:7: images[0]: not a readable image (")
    assert one_line_error(column("data:image/png;base64,@@@")) == "t.jsonl:7: images[0]: the data url's base64 does not decode"
    assert one_line_error(column("https://example.com/a.png")).startswith("t.jsonl:7: images[0]: remote image urls are not fetched")
    assert one_line_error(column(3)) == ("t.jsonl:7: images[0]: expected a path, a data url, bytes, a PIL image or an image "
                                         "feature ({bytes, path}), got int")
    parts = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert one_line_error(parts) == "t.jsonl:7: message 0 part 0: an image_url part needs image_url.url"
    assert one_line_error({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}).startswith(
        "t.jsonl:7: message 0 part 0: a content part must be a dict of type text, image or image_url")
    assert one_line_error({"answer": "1"}) == "t.jsonl:7: an image row needs 'prompt' or 'messages' (chat messages); the row has ['answer']"


def test_the_placeholders_must_match_the_images_one_for_one():
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    assert one_line_error({"prompt": two, "images": [png("red")]}) == (
        "t.jsonl:7: 2 image placeholder(s) in the messages but 1 image(s) in the images column; they must match one for one")
    assert one_line_error({"prompt": [{"role": "user", "content": "no image here"}], "images": [png("red")]}) == (
        "t.jsonl:7: 0 image placeholder(s) in the messages but 1 image(s) in the images column; they must match one for one")
    assert image_row({"prompt": "text only"}, "row 0") == {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "text only"}]}], "images": []}


def test_load_image_accepts_every_single_form(data_dir):
    forms = [Image.new("L", (2, 2), 255), png("white"), bytearray(png("white")), str(data_dir / "img" / "red.png"),
             data_dir / "img" / "red.png", {"path": str(data_dir / "img" / "red.png"), "bytes": None}]
    assert [pixel(load_image(f, "row 0")) for f in forms] == [(255, 255, 255)] * 3 + [(255, 0, 0)] * 3


def test_rows_feed_the_tiny_vl_processor():
    from posttrain.models.vision import make_tiny_vlm

    _, processor = make_tiny_vlm()
    row = image_row({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "vs"},
                                                             {"type": "image"}]}],
                     "images": [png("red", (64, 64)), png("blue", (80, 64))]}, "row 0")
    text = processor.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|><image>vs<image><|end|><|assistant|>"
    batch = processor(text=[text], images=row["images"], return_tensors="pt")
    assert batch["pixel_values"].shape == (2, 3, 64, 64) and int((batch["input_ids"] == 103).sum()) == 128
