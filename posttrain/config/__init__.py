"""Typed configs: schemas (`schema/`) and YAML + override loading (`loader.py`).

Imports only pydantic and PyYAML, so config errors answer before any heavy library loads.
"""

from posttrain.config.loader import (
    DEFAULT_CONFIGS,
    ConfigError,
    all_keys,
    config_to_yaml,
    default_config_path,
    load_config,
    parse_override,
    save_config,
)
from posttrain.config.schema import (
    SCHEMAS,
    DPOMasterConfig,
    EvalMasterConfig,
    GRPOMasterConfig,
    MasterConfig,
    PPOMasterConfig,
    RMMasterConfig,
    SFTMasterConfig,
)

__all__ = [
    "DEFAULT_CONFIGS",
    "SCHEMAS",
    "ConfigError",
    "DPOMasterConfig",
    "EvalMasterConfig",
    "GRPOMasterConfig",
    "MasterConfig",
    "PPOMasterConfig",
    "RMMasterConfig",
    "SFTMasterConfig",
    "all_keys",
    "config_to_yaml",
    "default_config_path",
    "load_config",
    "parse_override",
    "save_config",
]
