"""Environments: score model responses (and continue multi-turn episodes).

`create_env("math", cfg)` builds a registered environment (as a Ray actor by default);
`route_step` / `EnvRouter` step a batch that mixes several environments.
"""

from posttrain.environments.interface import Environment, EnvironmentReturn, last_assistant_text
from posttrain.environments.math_env import MathEnvironment, extract_answer
from posttrain.environments.registry import ENV_REGISTRY, EnvRouter, create_env, get_env_class, register_env, route_step

__all__ = [
    "ENV_REGISTRY",
    "EnvRouter",
    "Environment",
    "EnvironmentReturn",
    "MathEnvironment",
    "create_env",
    "extract_answer",
    "get_env_class",
    "last_assistant_text",
    "register_env",
    "route_step",
]
