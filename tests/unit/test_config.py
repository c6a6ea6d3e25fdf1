"""Config loading: YAML defaults inheritance, overrides, error messages, round trip, examples."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from posttrain.config import (
    DEFAULT_CONFIGS,
    SCHEMAS,
    ConfigError,
    all_keys,
    config_to_yaml,
    load_config,
    parse_override,
    save_config,
)
from posttrain.config.loader import EXAMPLE_CONFIG_DIR, suggest_key
from posttrain.config.schema.algorithms import GRPOConfig


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def problems_of(excinfo: pytest.ExceptionInfo) -> list[str]:
    return excinfo.value.problems


# ------------------------------------------------------------------------------------ inheritance
def test_multi_level_defaults_deep_merge(tmp_path):
    write(tmp_path / "base" / "base.yaml", """
        grpo: {num_prompts_per_step: 4, num_generations_per_prompt: 3, max_num_steps: 7}
        policy:
          train_global_batch_size: 8
          optimizer: {lr: 1e-3, weight_decay: 0.5}
          generation: {max_new_tokens: 10}
        data: {operations: [add, sub]}
        """)
    write(tmp_path / "base" / "mid.yaml", """
        defaults: base.yaml
        grpo: {num_generations_per_prompt: 2}
        data: {operations: [mul]}
        """)
    write(tmp_path / "extra.yaml", """
        grpo: {max_num_steps: 11}
        policy: {optimizer: {weight_decay: 0.25}}
        """)
    top = write(tmp_path / "top.yaml", """
        defaults: [base/mid.yaml, extra.yaml]
        policy: {optimizer: {lr: 2.5e-4}}
        """)
    cfg = load_config("grpo", top)
    assert cfg.grpo.num_prompts_per_step == 4  # from base, two levels down
    assert cfg.grpo.num_generations_per_prompt == 2  # mid overrides base
    assert cfg.grpo.max_num_steps == 11  # later defaults entry wins
    assert cfg.policy.optimizer.lr == 2.5e-4  # the including file wins over its defaults
    assert cfg.policy.optimizer.weight_decay == 0.25
    assert cfg.policy.generation.max_new_tokens == 10  # sibling dicts survive the merge
    assert cfg.data.operations == ["mul"]  # lists replace, not concatenate
    assert cfg.policy.generation.temperature == 1.0  # untouched keys keep schema defaults
    assert cfg.sft_warmup is None  # no embedded default underneath an explicit file


def test_defaults_cycle_is_an_error(tmp_path):
    write(tmp_path / "a.yaml", "defaults: b.yaml\n")
    write(tmp_path / "b.yaml", "defaults: [a.yaml]\n")
    with pytest.raises(ConfigError, match=r"cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_config("sft", tmp_path / "a.yaml")


def test_diamond_defaults_are_not_a_cycle(tmp_path):
    write(tmp_path / "root.yaml", "sft: {max_num_steps: 3}\n")
    write(tmp_path / "left.yaml", "defaults: root.yaml\n")
    write(tmp_path / "right.yaml", "defaults: root.yaml\nsft: {seed: 5}\n")
    cfg = load_config("sft", write(tmp_path / "top.yaml", "defaults: [left.yaml, right.yaml]\n"))
    assert (cfg.sft.max_num_steps, cfg.sft.seed) == (3, 5)


def test_missing_defaults_file_names_the_includer(tmp_path):
    top = write(tmp_path / "top.yaml", "defaults: nope.yaml\n")
    with pytest.raises(ConfigError, match=r"'.*nope\.yaml' not found \(in the defaults of .*top\.yaml\)"):
        load_config("sft", top)
    with pytest.raises(ConfigError, match=r"must be a file path or a list"):
        load_config("sft", write(tmp_path / "bad.yaml", "defaults: {a: 1}\n"))


# -------------------------------------------------------------------------------------- overrides
def test_overrides_parse_yaml_values():
    cfg = load_config(
        "grpo",
        overrides=[
            "policy.optimizer.lr=3e-4",  # PyYAML alone reads this as the string '3e-4'
            "policy.activation_checkpointing=true",
            "policy.generation.top_k=null",
            "policy.generation.stop_token_ids=[1, 2]",
            "policy.generation.colocated={enabled: false, num_workers: 2}",
            "+grpo.max_num_steps=9",
            "sft_warmup.sft.max_num_steps=5",
            "policy.model_name=1234",  # a string field keeps the text, not the number
            "sft_warmup.policy.model_name=1234",  # the warm start must train the same model
        ],
    )
    assert cfg.policy.optimizer.lr == 3e-4 and isinstance(cfg.policy.optimizer.lr, float)
    assert cfg.policy.activation_checkpointing is True
    assert cfg.policy.generation.top_k is None
    assert cfg.policy.generation.stop_token_ids == [1, 2]
    assert cfg.policy.generation.colocated.enabled is False
    assert cfg.policy.generation.colocated.num_workers == 2
    assert cfg.grpo.max_num_steps == 9
    assert cfg.sft_warmup.sft.max_num_steps == 5
    assert cfg.sft_warmup.sft.val_period == 25  # the rest of the embedded sft_warmup is kept
    assert cfg.policy.model_name == "1234"


def test_scientific_notation_in_files_and_values(tmp_path):
    cfg = load_config("sft", write(tmp_path / "c.yaml", "policy: {optimizer: {lr: 5e-5, eps: 1E-10}}\n"))
    assert (cfg.policy.optimizer.lr, cfg.policy.optimizer.eps) == (5e-5, 1e-10)
    assert parse_override("a.b=1e-4") == ("a.b", 1e-4)
    assert parse_override("a.b=-2e3") == ("a.b", -2000.0)
    assert parse_override("a=12") == ("a", 12) and isinstance(parse_override("a=12")[1], int)
    assert parse_override("a=x=y") == ("a", "x=y")
    assert parse_override("a=") == ("a", "")


def test_override_null_removes_optional_section():
    assert load_config("grpo").sft_warmup is not None
    assert load_config("grpo", overrides=["sft_warmup=null"]).sft_warmup is None


def test_override_dict_merges_into_section():
    cfg = load_config("sft", overrides=["policy.optimizer={lr: 0.5}"])
    assert cfg.policy.optimizer.lr == 0.5
    assert cfg.policy.optimizer.weight_decay == 0.0  # from sft_tiny.yaml, not reset


# --------------------------------------------------------------------------------- error messages
def test_unknown_key_on_command_line_suggests_closest():
    with pytest.raises(ConfigError) as excinfo:
        load_config("grpo", overrides=["grpo.num_prompt_per_step=4"])
    assert str(excinfo.value) == (
        "Unknown config key 'grpo.num_prompt_per_step' (from command line). "
        "Did you mean 'grpo.num_prompts_per_step'?"
    )


def test_unknown_key_in_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path / "c.yaml", """
        sft:
          max_num_steps: 3
        policy:
          optimizer:
            weight_decy: 0.1
        """)
    with pytest.raises(ConfigError) as excinfo:
        load_config("sft", path)
    message = str(excinfo.value)
    assert message.startswith("Unknown config key 'policy.optimizer.weight_decy' (from ")
    assert "c.yaml, line 5)" in message
    assert message.endswith("Did you mean 'policy.optimizer.weight_decay'?")


def test_unknown_key_from_a_defaults_file_names_that_file(tmp_path):
    write(tmp_path / "base.yaml", "sft:\n  max_steps: 3\n")
    top = write(tmp_path / "top.yaml", "defaults: base.yaml\n")
    with pytest.raises(ConfigError, match=r"'sft.max_steps' \(from .*base\.yaml, line 2\)\. Did you mean 'sft.max_num_steps'"):
        load_config("sft", top)


def test_suggestions():
    keys = all_keys(SCHEMAS["grpo"])
    assert suggest_key("policy.lr", keys) == "policy.optimizer.lr"  # same leaf, other section
    assert suggest_key("polcy", keys) == "policy"
    assert suggest_key("loss_fn.ratio_clip_maxx", keys) == "loss_fn.ratio_clip_max"
    assert suggest_key("zzzz.qqqq", keys) is None


def test_wrong_type_and_out_of_range_all_listed():
    with pytest.raises(ConfigError) as excinfo:
        load_config(
            "grpo",
            overrides=[
                "policy.optimizer.lr=abc",
                "grpo.num_generations_per_prompt=0",
                "policy.precision=fp8",
                "policy.generation.top_p=1.5",
                "policy.train_micro_batch_size=2.5",
                "logger.report=maybe",
            ],
        )
    assert sorted(problems_of(excinfo)) == sorted([
        "Config key 'policy.optimizer.lr' expects a number, got 'abc' (str) (from command line)",
        "Config key 'grpo.num_generations_per_prompt' must be >= 1, got 0 (from command line)",
        "Config key 'policy.precision' expects one of 'float32', 'bfloat16', 'float16' or 'auto', "
        "got 'fp8' (str) (from command line)",
        "Config key 'policy.generation.top_p' must be <= 1, got 1.5 (from command line)",
        "Config key 'policy.train_micro_batch_size' expects an integer, got 2.5 (float) (from command line)",
        "Config key 'logger.report' expects true or false, got 'maybe' (str) (from command line)",
    ])  # fmt: skip
    assert str(excinfo.value).startswith("6 config problems:\n  - ")


def test_wrong_type_in_file_and_list_items(tmp_path):
    path = write(tmp_path / "c.yaml", "policy:\n  generation:\n    stop_token_ids: [1, x]\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config("sft", path, ["policy.optimizer.betas=[0.9]"])
    assert problems_of(excinfo) == [  # in schema order
        "Config key 'policy.optimizer.betas' has too few items: item 1 is missing (from command line)",
        f"Config key 'policy.generation.stop_token_ids[1]' expects an integer, got 'x' (str) (from {path}, line 3)",
    ]


def test_cross_key_check_names_its_sources():
    with pytest.raises(ConfigError) as excinfo:
        load_config("grpo", overrides=["loss_fn.sequence_level_importance_ratios=true"])
    message = str(excinfo.value)
    assert message.startswith("Config key 'loss_fn': loss_fn.sequence_level_importance_ratios (GSPO) needs")
    assert "grpo_math_tiny.yaml and command line)" in message


def test_malformed_overrides():
    for bad in ["foo", "=1", "a..b=1", "a b=1", "1a=2"]:
        with pytest.raises(ConfigError, match=rf"Malformed override '{bad}' \(from command line\): expected dotted.key=value"):
            load_config("sft", overrides=[bad])
    with pytest.raises(ConfigError, match=r"Malformed override 'a=\[1,' \(from command line\): YAML syntax error"):
        load_config("sft", overrides=["a=[1,"])
    with pytest.raises(ConfigError, match=r"Cannot set 'policy.model_name.x' \(from command line\): 'policy.model_name' is 'tiny', not a section"):
        load_config("sft", overrides=["policy.model_name.x=1"])


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path / "broken.yaml", "sft:\n  max_num_steps: 3\n  seed: [1, 2\npolicy: {}\n")
    with pytest.raises(ConfigError, match=r"YAML syntax error in .*broken\.yaml, line 4, column \d+"):
        load_config("sft", path)
    dup = write(tmp_path / "dup.yaml", "sft:\n  seed: 1\n  seed: 2\n")
    with pytest.raises(ConfigError, match=r"Duplicate key 'sft.seed' in .*dup\.yaml, line 3"):
        load_config("sft", dup)
    with pytest.raises(ConfigError, match=r"must hold a mapping of keys, got list"):
        load_config("sft", write(tmp_path / "list.yaml", "- 1\n- 2\n"))


def test_missing_file_and_unknown_algorithm(tmp_path):
    with pytest.raises(ConfigError, match=r"Config file '.*nothing\.yaml' not found$"):
        load_config("sft", tmp_path / "nothing.yaml")
    with pytest.raises(ConfigError, match=r"Unknown algorithm 'trpo'; expected one of grpo, ppo, sft, dpo, rm, eval"):
        load_config("trpo")


def test_empty_file_gives_schema_defaults(tmp_path):
    assert load_config("rm", write(tmp_path / "empty.yaml", "# nothing\n")) == SCHEMAS["rm"]()


# ---------------------------------------------------------------------------- keys and round trip
def test_all_keys():
    keys = all_keys(SCHEMAS["grpo"])
    assert len(keys) == len(set(keys))
    for key in ["policy", "policy.optimizer.lr", "grpo.num_prompts_per_step", "loss_fn.ratio_clip_max",
                "sft_warmup.sft.max_num_steps", "sft_warmup.policy.generation.colocated.enabled"]:
        assert key in keys
    assert "sft.max_num_steps" not in keys
    assert all_keys(SCHEMAS["sft"])[:3] == ["seed", "policy", "policy.model_name"]


@pytest.mark.parametrize("algo", list(SCHEMAS))
def test_round_trip(algo, tmp_path):
    cfg = load_config(algo, overrides=["policy.optimizer.lr=1.25e-7", "policy.generation.stop_strings=['a: b', '#']"])
    path = save_config(cfg, tmp_path / "sub" / "resolved.yaml")
    assert load_config(algo, path) == cfg
    # Plain PyYAML (no posttrain loader) reads the same values too.
    assert yaml.safe_load(config_to_yaml(cfg)) == cfg.model_dump(mode="json")


# ---------------------------------------------------------------------------------- example files
def _algo_of(path: Path) -> str:
    return path.name.split("_")[0]


def test_every_example_config_validates():
    paths = sorted(EXAMPLE_CONFIG_DIR.glob("*.yaml"))
    assert {p.name for p in paths} >= set(DEFAULT_CONFIGS.values()) | {
        "grpo_dapo_tiny.yaml", "grpo_gspo_tiny.yaml", "grpo_drgrpo_tiny.yaml", "grpo_lora_tiny.yaml",
        "grpo_cispo_tiny.yaml"}
    for path in paths:
        assert _algo_of(path) in SCHEMAS, f"{path.name}: name must start with an algorithm"
        load_config(_algo_of(path), path)
        assert path.read_text().startswith("#"), f"{path.name} must open with a comment naming its source"


def test_embedded_grpo_default():
    cfg = load_config("grpo")
    assert (cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt) == (16, 8)
    assert cfg.policy.train_global_batch_size == 128 and cfg.sft_warmup.sft.max_num_steps == 700
    assert cfg.sft_warmup.sft.stop_at_validation == {"validation/accuracy_greedy": 0.6}
    assert cfg.policy.optimizer.lr == 1e-4 and cfg.policy.scheduler.name == "cosine"
    # The examples built on the default keep the settings they were measured with: its former warm
    # start (350 steps at lr 1e-3, no target) and a constant GRPO lr; everything else is the default's.
    v1 = load_config("grpo", EXAMPLE_CONFIG_DIR / "grpo_math_tiny_v1.yaml")
    assert (v1.sft_warmup.sft.max_num_steps, v1.sft_warmup.sft.val_period, v1.sft_warmup.sft.stop_at_validation,
            v1.sft_warmup.policy.optimizer.lr, v1.policy.scheduler.name) == (350, 50, {}, 1e-3, "constant")
    assert v1.model_dump(exclude={"sft_warmup", "policy"}) == cfg.model_dump(exclude={"sft_warmup", "policy"})
    assert v1.policy.model_dump(exclude={"scheduler"}) == cfg.policy.model_dump(exclude={"scheduler"})
    assert (v1.sft_warmup.model_dump(exclude={"sft", "policy"}) == cfg.sft_warmup.model_dump(exclude={"sft", "policy"}))
    assert cfg.policy.model_name == "tiny" and cfg.policy.tiny_arch == "llama"
    assert cfg.data.dataset == "arithmetic" and cfg.data.num_digits == 2
    assert cfg.sft_warmup is not None and cfg.sft_warmup.data.dataset == "arithmetic"


def test_variant_presets():
    dapo = load_config("grpo", EXAMPLE_CONFIG_DIR / "grpo_dapo_tiny.yaml")
    assert (dapo.loss_fn.ratio_clip_min, dapo.loss_fn.ratio_clip_max) == (0.2, 0.28)
    assert dapo.loss_fn.token_level_loss and dapo.grpo.use_dynamic_sampling and dapo.reward_shaping.enabled
    assert dapo.grpo.num_prompts_per_step == 16  # inherited from grpo_math_tiny.yaml
    assert dapo.sft_warmup.sft.max_num_steps == 350  # grpo_math_tiny_v1.yaml: as it was measured

    gspo = load_config("grpo", EXAMPLE_CONFIG_DIR / "grpo_gspo_tiny.yaml")
    assert gspo.loss_fn.sequence_level_importance_ratios and not gspo.loss_fn.token_level_loss
    assert (gspo.loss_fn.ratio_clip_min, gspo.loss_fn.ratio_clip_max) == (3e-4, 4e-4)

    drgrpo = load_config("grpo", EXAMPLE_CONFIG_DIR / "grpo_drgrpo_tiny.yaml")
    assert not drgrpo.grpo.normalize_rewards and drgrpo.loss_fn.token_level_loss

    cispo = load_config("grpo", EXAMPLE_CONFIG_DIR / "grpo_cispo_tiny.yaml")
    assert cispo.loss_fn.use_cispo and cispo.loss_fn.token_level_loss
    assert (cispo.loss_fn.ratio_clip_min, cispo.loss_fn.ratio_clip_max) == (1.0, 5.0)
    assert cispo.policy.train_global_batch_size == 64  # two optimizer steps per GRPO step: ratios != 1

    lora = load_config("grpo", EXAMPLE_CONFIG_DIR / "grpo_lora_tiny.yaml")
    assert lora.policy.lora.enabled and lora.policy.lora.dim == 8 and lora.policy.optimizer.lr == 1e-3


def test_grpo_batch_must_split_into_whole_optimizer_steps():
    with pytest.raises(ConfigError) as excinfo:
        load_config("grpo", overrides=["policy.train_global_batch_size=48"])
    assert problems_of(excinfo) == [
        "Config: policy.train_global_batch_size=48 must divide the rows of one GRPO step, "
        "grpo.num_prompts_per_step x grpo.num_generations_per_prompt = 128 (set it to 128 for one optimizer "
        "step per GRPO step) (from examples/configs/grpo_math_tiny.yaml and command line)"
    ]
    cfg = load_config("grpo", overrides=["policy.train_global_batch_size=32"])  # 4 optimizer steps per GRPO step
    assert cfg.policy.train_global_batch_size == 32

    with pytest.raises(ConfigError, match=r"policy.train_global_batch_size=128 must be a multiple of policy.num_workers=3"):
        load_config("grpo", overrides=["policy.num_workers=3"])


def test_unbuilt_features_are_refused_not_ignored():
    with pytest.raises(ConfigError, match=r"LoRA is supported for language models, not reward models"):
        load_config("rm", overrides=["policy.lora.enabled=true"])
    assert load_config("grpo", overrides=["policy.lora.enabled=true"]).policy.lora.enabled
    with pytest.raises(ConfigError, match=r"policy.generation.backend': 'vlm' is not a generation backend: one of 'native', 'vllm'"):
        load_config("grpo", overrides=["policy.generation.backend=vlm"])


def test_vllm_backend_config():
    gen = load_config("grpo", overrides=["policy.generation.backend=vllm"]).policy.generation
    assert gen.backend == "vllm" and gen.vllm_cfg.tensor_parallel_size == 1
    assert gen.verify_refit_enabled  # the logprob probe is on by default for vLLM
    assert not load_config("grpo").policy.generation.verify_refit_enabled
    assert not load_config("grpo", overrides=["policy.generation.backend=vllm", "policy.generation.verify_refit=false"]
                           ).policy.generation.verify_refit_enabled
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 needs GPUs: set cluster.gpus_per_node"):
        load_config("grpo", overrides=["policy.generation.backend=vllm", "policy.generation.vllm_cfg.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 must divide cluster.gpus_per_node=4"):
        load_config("grpo", overrides=["policy.generation.backend=vllm", "policy.generation.vllm_cfg.tensor_parallel_size=3",
                                       "cluster.gpus_per_node=4"])
    with pytest.raises(ConfigError, match=r"vllm_cfg.tensr_parallel_size"):
        load_config("grpo", overrides=["policy.generation.vllm_cfg.tensr_parallel_size=2"])


def test_grpo_refuses_filtered_sampling_the_trainer_cannot_match():
    for override in ("policy.generation.top_p=0.9", "policy.generation.top_k=20"):
        with pytest.raises(ConfigError, match="GRPO trains on the full distribution"):
            load_config("grpo", overrides=[override])
    assert load_config("eval", overrides=["policy.generation.top_p=0.9"]).policy.generation.top_p == 0.9


# ------------------------------------------------------------------ replacing or dropping a key
VL_EXAMPLE = EXAMPLE_CONFIG_DIR / "grpo_vl_tiny.yaml"  # data.generator_options: {max_count: 4}
TEXT_DATA = ["data.dataset=arithmetic", "data.generator=null"]


def test_a_derived_file_drops_an_inherited_mapping_with_delete(tmp_path):
    derived = write(tmp_path / "derived.yaml", f"""
        defaults: {VL_EXAMPLE}
        data:
          dataset: arithmetic
          generator: null
          generator_options: !delete
        """)
    cfg = load_config("grpo", derived)
    assert cfg.data.generator_options == {}  # the schema's default, not the example's {max_count: 4}
    example = load_config("grpo", VL_EXAMPLE)
    assert example.grpo.max_num_steps != GRPOConfig().max_num_steps  # so the next line tells
    assert cfg.grpo.max_num_steps == example.grpo.max_num_steps  # everything else is still inherited
    # Without the tag the inherited mapping stays and the run is refused, as before.
    write(derived, derived.read_text().replace(" !delete", " {}"))
    with pytest.raises(ConfigError, match="generator_options is read only with data.dataset=generated"):
        load_config("grpo", derived)


def test_a_derived_file_replaces_an_inherited_mapping_whole(tmp_path):
    base = write(tmp_path / "base.yaml", """
        policy: {optimizer: {name: adamw, lr: 2.0e-4, weight_decay: 0.5}}
        env: {math: {num_workers: 1, answer_format: last_number}}
        """)
    derived = write(tmp_path / "derived.yaml", """
        defaults: base.yaml
        policy:
          optimizer: !replace {name: adamw, lr: 1.0e-3}
        env:
          math: !replace
            num_workers: 2
        """)
    cfg = load_config("grpo", derived)
    default_wd = SCHEMAS["grpo"].model_fields["policy"].default.optimizer.weight_decay
    assert (cfg.policy.optimizer.lr, cfg.policy.optimizer.weight_decay) == (1e-3, default_wd)
    assert cfg.env.section("math").get("answer_format") != "last_number"
    # Plain merging, for comparison: the inherited keys stay.
    write(derived, derived.read_text().replace(" !replace", ""))
    assert load_config("grpo", derived).policy.optimizer.weight_decay == 0.5


def test_the_command_line_deletes_with_a_tilde_and_replaces_with_the_tag():
    cfg = load_config("grpo", VL_EXAMPLE, [*TEXT_DATA, "~data.generator_options"])
    assert cfg.data.generator_options == {}
    cfg = load_config("grpo", VL_EXAMPLE, [*TEXT_DATA, "data.generator_options=!delete"])
    assert cfg.data.generator_options == {}
    cfg = load_config("grpo", VL_EXAMPLE, ["policy.optimizer=!replace {name: adamw, lr: 1e-3}"])
    assert cfg.policy.optimizer.weight_decay != 0.0 and cfg.policy.optimizer.lr == 1e-3
    with pytest.raises(ConfigError, match="generator_options is read only"):
        load_config("grpo", VL_EXAMPLE, TEXT_DATA)
    # A key no file sets but the schema knows: nothing to drop. A typo: named, with the key meant.
    assert load_config("grpo", VL_EXAMPLE, ["~policy.generation.top_k"]).policy.generation.top_k is None
    with pytest.raises(ConfigError) as e:
        load_config("grpo", VL_EXAMPLE, ["~data.generator_option"])
    assert problems_of(e) == ["Cannot delete '~data.generator_option' (from command line): no config file sets it "
                              "and it is not a config key. Did you mean '~data.generator_options'?"]
    with pytest.raises(ConfigError, match=r"expected ~dotted.key \(no value\)"):
        load_config("grpo", VL_EXAMPLE, ["~data.generator_options=1"])


def test_delete_takes_no_value_and_names_the_line(tmp_path):
    bad = write(tmp_path / "bad.yaml", """
        data:
          generator_options: !delete {max_count: 3}
        """)
    with pytest.raises(ConfigError, match=r"'data.generator_options: !delete' takes no value, in .*bad.yaml, line 2"):
        load_config("grpo", bad)
