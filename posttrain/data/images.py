"""Rows with images, in the formats users bring, made into one shape: chat messages whose content
parts mark where each image goes (`{"type": "image"}`), and the images (PIL, RGB) in that order.

    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}],
     "images": [<PIL.Image.Image>], ...the row's other fields (answer, options, ...)}

That is what a vision-language processor takes (`processor.apply_chat_template(messages)` writes
the image tokens where the parts are; `processor(text=..., images=images)`). Accepted rows:

* TRL's: `prompt` (or `messages`) as chat messages with `{"type": "image"}` parts, and the images
  in an `images` column (or one in `image`), in the order of the parts.
* OpenAI's content parts: `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`
  (or the url as a string; a path or `file://` url works too).
* NeMo-RL's: `{"type": "image", "image": <path, data url, PIL image or {bytes, path}>}`.
* Images given as a path (relative to the data file's directory, or `base_dir`), a data url,
  bytes, a PIL image, or a `datasets.Image` feature's value (`{"bytes": ..., "path": ...}`).
* A message's content as a string is text; a prompt as a string is one user message (the images
  of the `images` column then go before the text, TRL's convention for a plain prompt).

Parts with their image inline and bare `{"type": "image"}` parts may be mixed: the bare ones take
the `images` column in order, and their count must equal its length. Every problem (a missing file,
bytes that are no image, an image over `max_pixels`, a count that does not match) is a `DataError`
in one line naming the row (`file:line` for a JSONL file, else `row N`) and the image.

A data set's rows with images are put in this shape when read (`datasets.load_records`), and a
vision-language model's processor turns them into tokens and pixels (`posttrain.models.vision_inputs`).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from PIL import Image

from posttrain.errors import DataError

# Default bound on an image's decoded size (width x height): 4096 x 4096. A vision-language
# processor resizes anyway; a bound stops a mislabelled or hostile file from taking the memory
# (PIL's own decompression-bomb limit, ~179M pixels, is far above what a row should carry).
MAX_PIXELS = 4096 * 4096


def _open(data: bytes | str | Path, what: str, at: str, max_pixels: int) -> Image.Image:
    """Decode an image from bytes or a file, checking its size before the pixels are read."""
    try:
        image = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
    except FileNotFoundError:
        raise DataError(f"{at}: {what}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{at}: {what}: is a directory, not an image file") from None
    except (Image.UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise DataError(f"{at}: {what}: not a readable image ({type(e).__name__})") from None
    return _checked(image, what, at, max_pixels)


def _checked(image: Image.Image, what: str, at: str, max_pixels: int) -> Image.Image:
    """`image` decoded and in RGB, when it has at most `max_pixels` pixels."""
    width, height = image.size
    if width * height > max_pixels:
        raise DataError(f"{at}: {what}: {width}x{height} is {width * height} pixels, over the limit of {max_pixels} "
                        "(max_pixels)")
    if width == 0 or height == 0:
        raise DataError(f"{at}: {what}: the image is empty ({width}x{height})")
    try:
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:  # a truncated or corrupt body behind a valid header
        raise DataError(f"{at}: {what}: not a readable image ({type(e).__name__}: {e})") from None


def _data_url_bytes(url: str, what: str, at: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header:
        raise DataError(f"{at}: {what}: a data url must be 'data:image/<type>;base64,<data>'")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise DataError(f"{at}: {what}: the data url's base64 does not decode") from None


def load_image(value: Any, at: str, what: str = "image", base_dir: Optional[str | os.PathLike] = None,
               max_pixels: int = MAX_PIXELS) -> Image.Image:
    """One image, decoded to RGB, from any accepted form (module docstring).

    Args:
        value: a PIL image, bytes, a path (str or Path), a `data:` or `file://` url, or a dict with
            `bytes` and/or `path` (a `datasets.Image` feature's value).
        at: the row, for errors (`train.jsonl:3`, `row 3`).
        what: the image within the row, for errors (default `image`).
        base_dir: the directory relative paths start from (default: the working directory).
        max_pixels: the largest width x height accepted (default `MAX_PIXELS`, 4096 x 4096).
    """
    if isinstance(value, Image.Image):
        return _checked(value, what, at, max_pixels)
    if isinstance(value, (bytes, bytearray)):
        return _open(bytes(value), what, at, max_pixels)
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # datasets.Image
        if value.get("bytes"):
            return _open(bytes(value["bytes"]), what, at, max_pixels)
        if value.get("path"):
            return load_image(value["path"], at, what, base_dir, max_pixels)
        raise DataError(f"{at}: {what}: an image feature with neither bytes nor path")
    if isinstance(value, (str, Path)):
        text = str(value)
        if text.startswith("data:"):
            return _open(_data_url_bytes(text, what, at), what, at, max_pixels)
        if text.startswith(("http://", "https://")):
            raise DataError(f"{at}: {what}: remote image urls are not fetched ({text[:60]}); download the image "
                            "and give its path")
        path = Path(text.removeprefix("file://")).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        return _open(path, f"{what} {text!r}", at, max_pixels)
    raise DataError(f"{at}: {what}: expected a path, a data url, bytes, a PIL image or an image feature "
                    f"({{bytes, path}}), got {type(value).__name__}")


def _inline_image(part: dict, at: str, what: str) -> Any:
    """The image a content part carries (None for a bare `{"type": "image"}` placeholder)."""
    if part["type"] == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not url:
            raise DataError(f"{at}: {what}: an image_url part needs image_url.url")
        return url
    for key in ("image", "url", "path"):  # NeMo-RL's `image`; transformers' chat templates' `url` / `path`
        if part.get(key) is not None:
            return part[key]
    return None


def _messages(row: dict, at: str) -> list[dict]:
    for key in ("prompt", "messages"):
        if key in row:
            value = row[key]
            break
    else:
        raise DataError(f"{at}: an image row needs 'prompt' or 'messages' (chat messages); the row has {sorted(row)}")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) and "role" in m for m in value):
        raise DataError(f"{at}: {key!r} must be a string or a non-empty list of {{role, content}} messages")
    return value


def _column_images(row: dict, at: str) -> list[Any]:
    if "images" in row and row["images"] is not None:
        images = row["images"]
        if not isinstance(images, (list, tuple)):
            raise DataError(f"{at}: 'images' must be a list of images, got {type(images).__name__}")
        return list(images)
    if row.get("image") is not None:
        return [row["image"]]
    return []


def has_images(row: dict) -> bool:
    """Whether a row carries images: an `images` / `image` column, or image parts in its prompt / messages."""
    if row.get("images") or row.get("image") is not None:
        return True
    for key in ("prompt", "messages"):
        value = row.get(key)
        if isinstance(value, list) and any(
                isinstance(m, dict) and isinstance(m.get("content"), list) and any(
                    isinstance(p, dict) and p.get("type") in ("image", "image_url") for p in m["content"])
                for m in value):
            return True
    return False


def prompt_text(messages: list[dict]) -> str:
    """The text parts of the last user message (of `image_row`'s messages): a row's `prompt` for
    prompt templates, logs and the environments that read it."""
    users = [m for m in messages if m["role"] == "user"] or messages
    return "".join(p.get("text", "") for p in users[-1]["content"] if p["type"] == "text")


def image_row(row: dict, at: str, base_dir: Optional[str | os.PathLike] = None,
              max_pixels: int = MAX_PIXELS) -> dict:
    """`row` in the one shape of the module docstring: `messages` (content as lists of text and
    bare image parts) and `images` (decoded, in the order of the parts); its other fields kept
    (`prompt`, `image` dropped). `at` names the row in errors; `base_dir` is where relative paths
    start; `max_pixels` bounds each image (default 4096 x 4096)."""
    column = _column_images(row, at)
    messages, found = [], []  # found: (what, value), one per image part in order; value None = from the column
    for m, message in enumerate(_messages(row, at)):
        content = message.get("content")
        if content is None:
            content = []
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = []
            for p, part in enumerate(content):
                what = f"message {m} part {p}"
                if isinstance(part, str):
                    part = {"type": "text", "text": part}
                if not isinstance(part, dict) or part.get("type") not in ("text", "image", "image_url"):
                    raise DataError(f"{at}: {what}: a content part must be a dict of type text, image or image_url, "
                                    f"got {part!r:.80}")
                if part["type"] == "text":
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
                    continue
                found.append((what, _inline_image(part, at, what)))
                parts.append({"type": "image"})
        else:
            raise DataError(f"{at}: message {m}: content must be a string or a list of parts, got {type(content).__name__}")
        messages.append({**message, "content": parts})
    bare = sum(value is None for _, value in found)
    if not found and column and isinstance(row.get("prompt", row.get("messages")), str):
        # A plain-text prompt with an images column: the images go first, in one user turn.
        messages[0]["content"] = [{"type": "image"} for _ in column] + messages[0]["content"]
        found, bare = [(f"image {i}", None) for i in range(len(column))], len(column)
    if bare != len(column):
        raise DataError(f"{at}: {bare} image placeholder(s) in the messages but {len(column)} image(s) in the images "
                        "column; they must match one for one")
    images, column_iter = [], iter(enumerate(column))
    for what, value in found:
        if value is None:
            i, value = next(column_iter)
            what = f"images[{i}]"
        images.append(load_image(value, at, what, base_dir, max_pixels))
    rest = {k: v for k, v in row.items() if k not in ("prompt", "messages", "images", "image")}
    return {**rest, "messages": messages, "images": images}


def image_rows(rows: Iterable[dict], locations: Optional[Sequence[str]] = None,
               base_dir: Optional[str | os.PathLike] = None, max_pixels: int = MAX_PIXELS) -> list[dict]:
    """`image_row` of each row (from the Python API: a list of dicts or a `datasets.Dataset`, whose
    `Image` features arrive as PIL images or `{bytes, path}` dicts); `locations` name the rows in
    errors (default `row N`)."""
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{locations[i] if locations else f'row {i}'}: expected a dict, got {type(row).__name__}")
        out.append(image_row(row, locations[i] if locations else f"row {i}", base_dir, max_pixels))
    return out

