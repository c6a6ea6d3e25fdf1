"""Plugging in a user's code by config: import paths, registries, environment sections."""

from __future__ import annotations

import sys

import pytest
import torch

from posttrain.algorithms.advantages import compute_advantages
from posttrain.algorithms.loss import ClippedPGLoss, build_loss
from posttrain.config import ConfigError, load_config
from posttrain.config.schema import LossConfig
from posttrain.environments.registry import resolve_env
from posttrain.errors import UserError
from posttrain.preflight import check_components, check_envs
from posttrain.utils.registry import ImportPathError, import_object, resolve

PLUGIN = '''
import torch
from pydantic import BaseModel, ConfigDict
from posttrain.environments.interface import Environment

class Cfg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bonus: float = 0.0

class MyEnv(Environment):
    config_class = Cfg
    def __init__(self, cfg):
        self.cfg = cfg
    def step(self, message_logs, metadata):
        raise NotImplementedError

class MyLoss:
    def __init__(self, weight=1.0):
        self.weight = weight

def plus_one(rewards, group_ids, sample_mask=None, amount=1.0):
    return rewards + amount

NOT_CALLABLE = 3
'''


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "user_plugin.py").write_text(PLUGIN)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("user_plugin", None)


def test_import_object_forms_and_errors(plugin_dir):
    assert import_object("user_plugin:plus_one")(torch.tensor([1.0]), None).tolist() == [2.0]
    assert import_object(str(plugin_dir / "user_plugin.py") + ":MyLoss")().weight == 1.0
    with pytest.raises(ImportPathError, match="no module named 'nope'"):
        import_object("nope:thing")
    with pytest.raises(ImportPathError, match="has no attribute 'Missing'"):
        import_object("user_plugin:Missing")
    with pytest.raises(ImportPathError, match="does not exist"):
        import_object("missing_file.py:X")
    with pytest.raises(ImportPathError, match="is not of the form"):
        import_object("user_plugin")


def test_resolve_registry_or_import_path(plugin_dir):
    registry = {"a": 1}
    assert resolve(registry, "a", "thing") == 1
    assert resolve(registry, "user_plugin:NOT_CALLABLE", "thing") == 3
    with pytest.raises(KeyError, match="unknown thing 'b'"):
        resolve(registry, "b", "thing")


def test_custom_loss_and_estimator_by_config(plugin_dir):
    assert isinstance(build_loss(LossConfig()), ClippedPGLoss)
    loss = build_loss(LossConfig(name="user_plugin:MyLoss", kwargs={"weight": 3.0}))
    assert loss.weight == 3.0
    adv = compute_advantages("user_plugin:plus_one", torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), amount=2.0)
    assert adv.tolist() == [2.0, 3.0]
    # reinforce_pp was registered but unreachable from config before.
    cfg = load_config("grpo", overrides=["grpo.adv_estimator.name=reinforce_pp", "sft_warmup=null"])
    assert cfg.grpo.adv_estimator.name == "reinforce_pp"
    check_components(cfg)


def test_component_errors_name_the_key(plugin_dir):
    with pytest.raises(ConfigError, match="loss_fn.kwargs is for a custom loss"):
        load_config("grpo", overrides=["loss_fn.kwargs={a: 1}"])
    with pytest.raises(ConfigError, match="grpo.adv_estimator.name='a:b:c'"):
        load_config("grpo", overrides=["grpo.adv_estimator.name=a:b:c"])
    cfg = load_config("grpo", overrides=["grpo.adv_estimator.name=grop"])
    with pytest.raises(UserError, match=r"grpo.adv_estimator.name: unknown advantage estimator 'grop'.*did you mean 'grpo'"):
        check_components(cfg)
    cfg = load_config("grpo", overrides=["loss_fn.name=user_plugin:NOT_CALLABLE"])
    with pytest.raises(UserError, match="loss_fn.name='user_plugin:NOT_CALLABLE' is not callable"):
        check_components(cfg)


def test_environment_sections(plugin_dir):
    cfg = load_config("grpo", overrides=["env.mine.class_path=user_plugin:MyEnv", "env.mine.bonus=0.5"])
    cls, env_cfg = resolve_env("mine", cfg.env.section("mine"))
    assert cls.__name__ == "MyEnv" and env_cfg.bonus == 0.5
    check_envs(cfg, {"mine", "math"})
    with pytest.raises(UserError, match="task_name='other': no environment serves it.*set env.other.class_path"):
        check_envs(cfg, {"other"})
    typo = load_config("grpo", overrides=["env.mine.class_path=user_plugin:MyEnv", "env.mine.bonsu=1"])
    with pytest.raises(UserError, match=r"env.mine.bonsu: unknown field of env.mine; did you mean env.mine.bonus\?"):
        check_envs(typo, {"mine"})
    wrong = load_config("grpo", overrides=["env.mine.class_path=user_plugin:MyLoss"])
    with pytest.raises(UserError, match="is not an Environment subclass"):
        check_envs(wrong, {"mine"})
    with pytest.raises(ConfigError, match="env.bad.class_path='nocolon' must be"):
        load_config("grpo", overrides=["env.bad.class_path=nocolon"])


def test_jsonl_rows_keep_their_task_name(tmp_path):
    from posttrain.data.datasets import load_records

    (tmp_path / "t.jsonl").write_text('{"prompt": "a", "answer": 1, "task_name": "mine"}\n{"prompt": "b", "answer": 2}\n')
    cfg = load_config("sft", overrides=["data.dataset=jsonl", f"data.train_path={tmp_path / 't.jsonl'}"])
    assert [r["task_name"] for r in load_records(cfg.data, "train")] == ["mine", "math"]


def test_a_config_finds_the_module_beside_it_from_any_directory(tmp_path, monkeypatch):
    """examples/custom/grpo_custom.yaml names `my_task:ParityEnv` (my_task.py beside it): it loads
    from the repository root, or anywhere, not only from examples/custom."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config("grpo", repo / "examples/custom/grpo_custom.yaml")
    my_task = repo / "examples/custom/my_task.py"
    assert cfg.env.section("parity")["class_path"] == f"{my_task}:ParityEnv"
    assert cfg.loss_fn.name == f"{my_task}:ScaledPGLoss"
    assert cfg.grpo.adv_estimator.name == f"{my_task}:shifted_group_mean"
    assert resolve_env("parity", cfg.env.section("parity"))[0].__name__ == "ParityEnv"
    sys.modules.pop("my_task", None)
    # Only import paths of files that are there change: an installed module's path stays as it is.
    (tmp_path / "c.yaml").write_text("loss_fn:\n  name: posttrain.algorithms.loss:ClippedPGLoss\n"
                                     "env:\n  math:\n    class_path: nowhere:Env\n")
    cfg = load_config("grpo", tmp_path / "c.yaml", ["sft_warmup=null"])
    assert cfg.loss_fn.name == "posttrain.algorithms.loss:ClippedPGLoss"
    assert cfg.env.section("math")["class_path"] == "nowhere:Env"


def test_a_missing_module_suggests_its_file_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ImportPathError) as info:
        import_object("their_task:ParityEnv")
    assert "give its path: 'path/to/their_task.py:ParityEnv'" in str(info.value)


def test_generation_backends_are_registered_and_named_by_config(plugin_dir):
    from posttrain.config.schema.policy import BUILTIN_GENERATION_BACKENDS
    from posttrain.models.generation.backends import GENERATION_BACKENDS, generation_backend_class
    from posttrain.models.generation.interface import GenerationInterface
    from posttrain.models.generation.native import NativeGeneration
    from posttrain.models.generation.vllm_generation import VllmGeneration

    assert generation_backend_class("native") is NativeGeneration
    assert generation_backend_class("vllm") is VllmGeneration
    # The names the schema accepts are exactly the registered built-ins.
    assert set(BUILTIN_GENERATION_BACKENDS) == set(GENERATION_BACKENDS) == {"native", "vllm"}
    (plugin_dir / "user_backend.py").write_text(
        "from posttrain.models.generation.native import NativeGeneration\n"
        "class MyGeneration(NativeGeneration):\n    pass\n"
    )
    try:
        cls = generation_backend_class("user_backend:MyGeneration")
        assert cls.__name__ == "MyGeneration" and issubclass(cls, GenerationInterface)
        cfg = load_config("grpo", overrides=["policy.generation.backend=user_backend:MyGeneration"])
        check_components(cfg)  # the import path resolves to a GenerationInterface
    finally:
        sys.modules.pop("user_backend", None)
    with pytest.raises(TypeError, match="'user_plugin:MyLoss' is not a GenerationInterface subclass"):
        generation_backend_class("user_plugin:MyLoss")


TOY_BACKEND = '''
from posttrain.models.generation.interface import GenerationInterface

class ToyGeneration(GenerationInterface):
    """No workers: records what it was built from."""
    def __init__(self, cluster, spec, **placement):
        self.cluster, self.spec, self.placement = cluster, spec, placement
        self.weights_version = 0
    def generate(self, batch, greedy=False, params=None): raise NotImplementedError
    def prepare_for_generation(self): return True
    def finish_generation(self): return True
    def weight_dtypes(self): raise NotImplementedError
    def prepare_refit_info(self, metadata): pass
    def update_weights(self, buffers, version): pass
    def load_bucket(self, buffer, bucket): pass
    def finish_refit(self, version): pass
    def shutdown(self): return True
'''


def test_the_job_builds_a_backend_named_by_import_path(plugin_dir):
    """`policy.generation.backend: module:Class` is the class `make_generation` builds, from one
    `GenerationSpec` of the job (no workers, no Ray)."""
    from posttrain.job import make_generation

    (plugin_dir / "toy_backend.py").write_text(TOY_BACKEND)
    try:
        cfg = load_config("grpo", overrides=["policy.generation.backend=toy_backend:ToyGeneration",
                                             "policy.generation.max_new_tokens=7", "cluster.worker_timeout_s=30"])
        check_components(cfg)
        cluster = object()
        generation = make_generation(cfg, cluster, seed=11, name="toy")
        assert type(generation).__name__ == "ToyGeneration" and type(generation).__module__ == "toy_backend"
        assert generation.cluster is cluster and generation.placement == {"name": "toy"}
        spec = generation.spec
        assert (spec.model_name, spec.seed, spec.worker_timeout_s, spec.config.max_new_tokens) == (
            cfg.policy.model_name, 11, 30.0, 7)
        assert spec.max_model_len == cfg.policy.max_total_sequence_length
    finally:
        sys.modules.pop("toy_backend", None)


def test_a_registered_name_resolves_and_an_unknown_one_lists_the_registered(plugin_dir):
    from posttrain.models.generation.backends import (GENERATION_BACKENDS, generation_backend_class,
                                                      register_generation_backend)

    (plugin_dir / "toy_backend.py").write_text(TOY_BACKEND)
    toy = import_object("toy_backend:ToyGeneration")
    try:
        assert register_generation_backend("toy")(toy) is toy
        assert generation_backend_class("toy") is toy
        with pytest.raises(ValueError, match="generation backend 'native' is already registered"):
            register_generation_backend("native")(toy)
        with pytest.raises(KeyError, match=r"unknown generation backend 'vlm' \(registered: \['native', 'toy', "
                                           r"'vllm'\]; or give 'module:attr'\); did you mean 'vllm'\?"):
            generation_backend_class("vlm")
    finally:
        GENERATION_BACKENDS.pop("toy", None)
        sys.modules.pop("toy_backend", None)
    assert "vllm" not in sys.modules  # the vllm backend's module imports vLLM only in its workers


def test_the_example_backend_loads_by_config():
    """examples/custom/my_engine.py, the example of docs/extending.md, names a backend the job accepts."""
    from pathlib import Path

    from posttrain.models.generation.native import NativeGeneration

    example = Path(__file__).resolve().parents[2] / "examples/custom/my_engine.py"
    cfg = load_config("grpo", overrides=[f"policy.generation.backend={example}:CountingGeneration"])
    try:
        check_components(cfg)
        from posttrain.models.generation.backends import generation_backend_class

        assert issubclass(generation_backend_class(cfg.policy.generation.backend), NativeGeneration)
    finally:
        sys.modules.pop("my_engine", None)


def test_an_unknown_generation_backend_fails_at_config_load():
    with pytest.raises(ConfigError, match=r"policy.generation.backend.*'vlm' is not a generation backend: one of "
                                          r"'native', 'vllm', or a class of your own as 'module:Class'"):
        load_config("grpo", overrides=["policy.generation.backend=vlm"])
    with pytest.raises(ConfigError, match=r"policy.generation.backend='a:b:c' is not a registered name"):
        load_config("grpo", overrides=["policy.generation.backend=a:b:c"])
    cfg = load_config("grpo", overrides=["policy.generation.backend=nope:Missing"])
    with pytest.raises(UserError, match="policy.generation.backend: 'nope:Missing': no module named 'nope'"):
        check_components(cfg)


def test_generation_spec_of_a_job():
    """One spec carries what every backend's controller and workers are built from."""
    from posttrain.models.generation.spec import GenerationSpec

    cfg = load_config("distill", overrides=["policy.max_total_sequence_length=48", "cluster.worker_timeout_s=60",
                                            "policy.generation.max_new_tokens=5"])
    spec = GenerationSpec.from_config(cfg, seed=3)
    assert (spec.model_name, spec.tokenizer_name, spec.max_model_len, spec.seed, spec.worker_timeout_s) == (
        cfg.policy.model_name, cfg.policy.tokenizer_name, 48, 3, 60.0)
    assert spec.config.max_new_tokens == 5 and spec.generation["max_new_tokens"] == 5
    teacher = GenerationSpec.from_config(cfg, model=cfg.teacher)
    assert (teacher.model_name, teacher.precision) == (cfg.teacher.model_name, cfg.teacher.precision)
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationSpec("tiny", {"max_new_tokens": 0})
