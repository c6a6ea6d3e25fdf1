"""`data` and `env`: prompt sets (one, or a blend) and the environments that score them."""

from __future__ import annotations

import difflib
import re
from typing import Any, Literal, Optional, Union

from pydantic import ConfigDict, Field, field_validator, model_validator

from posttrain.config.schema.base import Section, check_component_name

# Validation problems made from `data.seed` are seeded apart from training ones: training row i
# uses seed `data.seed + i`, validation row i `data.seed + VALIDATION_SEED_OFFSET + i` (reasoning
# gym, `data.dataset=env`), so the two never share a generator stream while a split has fewer
# rows than the offset (the sizes below are capped at it). Defined here, the lowest layer, for
# every part that makes rows from a seed.
VALIDATION_SEED_OFFSET = 10**7


def split_seed(data_seed: int, split: str) -> int:
    """The first seed of a split's rows: `data_seed` for "train", `data_seed +
    VALIDATION_SEED_OFFSET` for "validation"."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    return data_seed + (VALIDATION_SEED_OFFSET if split == "validation" else 0)


class ReasoningGymTask(Section):
    """One reasoning-gym task of `data.dataset=reasoning_gym` (`data.reasoning_gym`)."""

    name: str = Field(description="reasoning-gym data set name, e.g. 'chain_sum', 'spell_backward'.")
    config: dict[str, Any] = Field({}, description="Keyword arguments of reasoning_gym.create_dataset (the task's own config).")
    size: int = Field(
        1000, ge=1, le=VALIDATION_SEED_OFFSET, description="Training problems (seeds data.seed + 0 .. size - 1)."
    )
    val_size: int = Field(
        100, ge=0, le=VALIDATION_SEED_OFFSET,
        description="Validation problems (seeds from data.seed + 10**7; questions also in training dropped).",
    )
    weight: float = Field(1.0, gt=0, description="Share of each GRPO batch drawn from this task.")
    prompt_template: Optional[Union[str, list[str]]] = Field(
        None,
        description=(
            "Prompt built from the entry's fields: {question} and the entry's metadata keys (e.g. '{expression} ='), "
            "or a list of such templates, one drawn per entry (by the seed); None uses the question."
        ),
    )
    unseen_prompt_template: list[str] = Field(
        [],
        description=(
            "Templates held out of training (data.phrasings: 'seen' draws from prompt_template, 'unseen' from these, "
            "'all' from both), to validate on wordings the model never trained on."
        ),
    )

    @field_validator("prompt_template")
    @classmethod
    def _some_template(cls, template: Optional[Union[str, list[str]]]) -> Optional[Union[str, list[str]]]:
        if isinstance(template, list) and not template:
            raise ValueError("an empty list: give one template or more (or none: the question)")
        return template

    def prompt_templates(self, phrasings: str) -> list[Optional[str]]:
        """The templates `phrasings` (`data.phrasings`) draws from; `[None]`: the question itself."""
        seen = [self.prompt_template] if not isinstance(self.prompt_template, list) else self.prompt_template
        if phrasings == "seen" or (phrasings == "all" and not self.unseen_prompt_template):
            return seen
        return self.unseen_prompt_template if phrasings == "unseen" else seen + self.unseen_prompt_template


# The built-in task generators of `data.dataset=generated` (`posttrain.data.generators`, which this
# layer does not import; tests/unit/test_task_generators.py keeps the two lists equal).
TASK_GENERATORS = ("word_problems", "multiple_choice", "json_output", "instructions", "functions", "calculator")
# Generators of rows with images (`posttrain.data.generators.visual`), for a vision-language policy
# (`policy.model_name: tiny-vl`); preflight refuses them with a text model in one line.
VISUAL_TASK_GENERATORS = ("shape_count", "shape_color", "shape_position", "read_number", "read_word")


class DataConfig(Section):
    """Prompt (or SFT / preference) data and how rows become prompts."""

    dataset: Literal["arithmetic", "jsonl", "hf", "reasoning_gym", "env", "generated"] = Field(
        "arithmetic",
        description=(
            "Prompt source: 'arithmetic' (synthetic, seeded), 'jsonl' (train_path / validation_path), 'hf' (a Hugging "
            "Face data set), 'reasoning_gym' (generated tasks), 'env' (episodes made by the environment "
            "data.env_name, e.g. sliding_puzzle boards; data.num_train / num_validation / seed) or 'generated' "
            "(the task generator data.generator, for a built-in environment)."
        ),
    )
    train_path: Optional[str] = Field(None, description="JSONL file or HF dataset name (jsonl / hf).")
    validation_path: Optional[str] = Field(
        None,
        description=(
            "Validation split: a JSONL file ('jsonl') or NAME[:CONFIG][@SPLIT] ('hf'); None trains without validation."
        ),
    )
    prompt_key: str = Field("prompt", description="Field of a row holding the prompt (text or chat messages).")
    answer_key: str = Field("answer", description="Field of a row holding the reference answer the environment checks.")
    chosen_key: str = Field("chosen", description="Preferred response of a preference pair (dpo / rm; jsonl / hf).")
    rejected_key: str = Field("rejected", description="Dispreferred response of a preference pair (dpo / rm).")
    prompt_template: str = Field(
        "{prompt}",
        description=(
            "Python format string making each prompt from its row: {prompt} and the row's other fields (arithmetic "
            "rows also have {a}, {op} and {b}: 'What is {a} {op} {b}?')."
        ),
    )
    use_chat_template: bool = Field(
        True,
        description="Render prompts with the tokenizer's chat template (as a user turn); false feeds the raw text.",
    )
    system_prompt: Optional[str] = Field(
        None,
        description="System message put before every prompt (with the chat template).",
    )
    # Synthetic arithmetic
    operations: list[Literal["add", "sub", "mul"]] = Field(
        ["add"],
        description="Arithmetic data: operations to draw from ('add', 'sub', 'mul').",
    )
    num_digits: int = Field(2, ge=1, le=12, description="Arithmetic data: digits per operand.")
    num_train: int = Field(8000, ge=1, description="Synthetic data (arithmetic, generated, env): training rows made.")
    num_validation: int = Field(
        500, ge=1,
        description="Synthetic data (arithmetic, generated, env): validation rows made (disjoint from training).",
    )
    seed: int = Field(1234, description="Seed of synthetic data generation.")
    generator: Optional[str] = Field(
        None,
        description=(
            "Task generator of data.dataset=generated: " + ", ".join(TASK_GENERATORS) + " (rows for the math, mcqa, "
            "structured, instructions, code and tools environments; docs/environments.md), or 'module:function'. "
            "A single generated source's rows are task <generator>, scored by its environment."
        ),
    )
    generator_options: dict[str, Any] = Field(
        {}, description="Keyword options of data.generator (each generator's docstring lists its options and defaults).",
    )
    phrasings: Literal["all", "seen", "unseen"] = Field(
        "all",
        description=(
            "Wordings of generated prompts (the built-in generators' and data.reasoning_gym's prompt templates): 'all', "
            "'seen' (the templates a model trains on) or 'unseen' (those held out of training, to validate on "
            "wordings a model never saw); the problems are the same whichever is chosen."
        ),
    )
    validation_sets: dict[str, dict[str, Any]] = Field(
        {},
        description=(
            "More validation sets, each a name and the data.* keys that make it from this section (e.g. "
            "{unseen_phrasing: {phrasings: unseen}}): grpo and distill validate on each one's validation split beside "
            "this section's and log it as validation_<name>/...; eval scores each beside the validation split."
        ),
    )
    shuffle: bool = Field(
        True,
        description="Shuffle training rows each epoch (resumable: the order is a function of seed and epoch).",
    )
    env_name: str = Field(
        "math",
        description="Task of rows that name none (a JSONL row's own task_name wins); env.<task> serves it.",
    )
    reasoning_gym: list[ReasoningGymTask] = Field(
        [], description="Tasks of data.dataset=reasoning_gym (optional extra: pip install 'posttrain[reasoning_gym]')."
    )
    blend: list[dict[str, Any]] = Field(
        [],
        description=(
            "Several data sets in one run: a list of {name, weight (default 1), env (default: name), <data.* keys>}; "
            "each component's data.* keys override this section's, its rows get task_name=name unless they carry "
            "their own, and GRPO draws each prompt from component i with probability weight_i / sum(weights)."
        ),
    )

    @field_validator("generator")
    @classmethod
    def _known_generator(cls, name: Optional[str]) -> Optional[str]:
        if name is None or ":" in name:
            check_component_name(name or "", "data.generator")
            return name
        if name in VISUAL_TASK_GENERATORS:
            return name  # rows with images, for a vision-language policy (preflight checks the model)
        if name not in TASK_GENERATORS:
            close = difflib.get_close_matches(name, TASK_GENERATORS, n=1, cutoff=0.0)
            raise ValueError(f"{name!r} is not a task generator; did you mean {close[0]!r}? "
                             f"(built in: {', '.join(TASK_GENERATORS)}; or 'module:function')")
        return name

    @model_validator(mode="after")
    def _check(self):
        if self.dataset == "generated" and self.generator is None and not self.blend:
            raise ValueError(f"data.dataset=generated needs data.generator: one of {', '.join(TASK_GENERATORS)}")
        if self.dataset != "generated" and (self.generator is not None or self.generator_options):
            key = "data.generator" if self.generator is not None else "data.generator_options"
            raise ValueError(f"{key} is read only with data.dataset=generated (got data.dataset={self.dataset!r})")
        if self.dataset == "reasoning_gym" and not self.reasoning_gym and not self.blend:
            raise ValueError("data.dataset=reasoning_gym needs data.reasoning_gym: a list of {name, config, size, val_size}")
        names = [task.name for task in self.reasoning_gym]
        if len(set(names)) != len(names):
            raise ValueError(f"data.reasoning_gym names a task twice: {names}")
        if self.phrasings == "unseen" and self.dataset == "reasoning_gym":
            for t, task in enumerate(self.reasoning_gym):
                if not task.unseen_prompt_template:
                    raise ValueError(f"data.reasoning_gym[{t}].unseen_prompt_template is needed with data.phrasings=unseen "
                                     f"(the prompt templates held out of training; task {task.name!r} has none)")
        for name in self.validation_sets:
            validation_set(self, name)  # raises naming data.validation_sets.<name>.<key>
        seen = set()
        for i, component in enumerate(self.blend):
            name = blend_component(self, i)[0]  # raises naming data.blend[i].<key>
            if name in seen:
                raise ValueError(f"data.blend[{i}].name={name!r} is used twice")
            seen.add(name)
        return self


BLEND_KEYS = ("name", "weight", "env")


def blend_component(data: "DataConfig", index: int) -> tuple[str, float, str, "DataConfig"]:
    """(name, weight, env section, the component's own DataConfig) of `data.blend[index]`."""
    component = data.blend[index]
    key = f"data.blend[{index}]"
    if not isinstance(component, dict):
        raise ValueError(f"{key} must be a section {{name, weight, env, <data.* keys>}}, got {component!r}")
    name = component.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{key}.name is required (the task name of its rows, e.g. 'math')")
    weight = component.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise ValueError(f"{key}.weight must be a number > 0, got {weight!r}")
    env = component.get("env", name)
    if not isinstance(env, str) or not env:
        raise ValueError(f"{key}.env must be an environment name, got {env!r}")
    overrides = {k: v for k, v in component.items() if k not in BLEND_KEYS}
    if "blend" in overrides:
        raise ValueError(f"{key}.blend: blends do not nest")
    fields = data.model_dump(exclude={"blend", "validation_sets"}, exclude_unset=True)
    return name, float(weight), env, _derived(fields, {**overrides, "env_name": name}, key)


def validation_set(data: "DataConfig", name: str) -> "DataConfig":
    """The data section of `data.validation_sets[name]`: `data` with the set's keys in place of its
    own (a blend's components inherit them, as any key of `data`, unless they set it themselves)."""
    key = f"data.validation_sets.{name}"
    if not re.fullmatch(r"[A-Za-z0-9_]+", name):
        raise ValueError(f"{key}: a validation set's name is letters, digits and _ (it names the metrics "
                         f"validation_<name>/...)")
    overrides = data.validation_sets[name]
    if not isinstance(overrides, dict):
        raise ValueError(f"{key} must be a section of data.* keys, got {overrides!r}")
    if "validation_sets" in overrides:
        raise ValueError(f"{key}.validation_sets: validation sets do not nest")
    return _derived(data.model_dump(exclude={"validation_sets"}, exclude_unset=True), overrides, key)


def _derived(fields: dict[str, Any], overrides: dict[str, Any], key: str) -> "DataConfig":
    """`DataConfig` of `fields` with `overrides` in place; an error names `<key>.<field>`."""
    from pydantic import ValidationError

    try:
        return DataConfig.model_validate({**fields, **overrides})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        if first["type"] == "value_error":  # a validator's own message: it names the value
            message = first["msg"].removeprefix("Value error, ")
            if where:
                raise ValueError(f"{key}.{where}: {message}") from None
            raise ValueError(re.sub(r"\bdata\.", f"{key}.", message)) from None  # data.<x> is this one's
        raise ValueError(f"{key}.{where}: {first['msg']} (got {first.get('input')!r})") from None


# ---------------------------------------------------------------------------------- environments
class EnvConfig(Section):
    """`env.<name>` configures the environment serving task `<name>` (rows carry a task name:
    `data.env_name`, or a JSONL row's own `task_name`). A built-in environment (math, code, mcqa,
    structured, instructions, reasoning_gym) or one registered with `@register_env` takes just its
    fields; a user's environment is `{class_path: "module:Class" or "file.py:Class", <fields>}`, and
    reward functions (TRL's signature) are `{reward_fn: "module:function" or a list, weights: [...]}`. The
    fields are validated against the class's `config_class` (a pydantic model, kept beside the
    environment) by `posttrain.preflight` before any worker starts; this schema does not import
    the environments, so loading a config stays fast."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    @model_validator(mode="after")
    def _check(self):
        for name, section in (self.model_extra or {}).items():
            if not isinstance(section, dict):
                raise ValueError(f"env.{name} must be a section (class_path and the environment's fields), got {section!r}")
            class_path = section.get("class_path")
            if class_path is not None and (not isinstance(class_path, str) or ":" not in class_path):
                raise ValueError(f"env.{name}.class_path={class_path!r} must be 'module:Class' or 'file.py:Class'")
            check_component_name(class_path or name, f"env.{name}.class_path")
            if "reward_fn" in section:
                if class_path is not None:
                    raise ValueError(f"env.{name}: give class_path (an Environment) or reward_fn (functions), not both")
                functions = section["reward_fn"]
                names = [functions] if isinstance(functions, str) else functions
                if not isinstance(names, list) or not names or not all(isinstance(f, str) and ":" in f for f in names):
                    raise ValueError(f"env.{name}.reward_fn={functions!r} must be 'module:function' or "
                                     "'file.py:function', or a list of them")
                for i, function in enumerate(names):
                    check_component_name(function, f"env.{name}.reward_fn" + (f"[{i}]" if len(names) > 1 else ""))
        return self

    def section(self, name: str) -> Any:
        """The config given for environment `name` (a dict), or None."""
        return (self.model_extra or {}).get(name)

    def names(self) -> list[str]:
        """The environments configured here."""
        return sorted(self.model_extra or {})
