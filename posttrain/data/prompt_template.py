"""`data.prompt_template` applied to a row: shared by every record source (`datasets`,
`reasoning_gym`, `preference`), so none of them imports another for it."""

from __future__ import annotations

from posttrain.config.schema import DataConfig
from posttrain.errors import DataError


def format_prompt(data_cfg: DataConfig, fields: dict, at: str) -> str:
    """`data.prompt_template` filled with `fields`; a failure is a `DataError` naming `at` (where the row is from)."""
    try:
        return data_cfg.prompt_template.format(**fields)
    except (KeyError, IndexError, ValueError) as e:
        raise DataError(
            f"{at}: data.prompt_template {data_cfg.prompt_template!r} failed: {type(e).__name__}: {e} "
            f"(fields available: {sorted(fields)})"
        ) from None
