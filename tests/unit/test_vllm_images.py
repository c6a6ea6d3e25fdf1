"""Images through vLLM, the parts that need no vLLM: the prompt's image tokens handed back to
vLLM's processor, the vision tower's names for vLLM 0.32's loader, the images a generation batch
carries, and the start-up hook that lets torchvision import on CPU torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from posttrain.models.generation.vllm_extension import checkpoint_needs_vllm_names, vllm_checkpoint_name
from posttrain.models.generation.vllm_worker import collapse_image_tokens

IMG = 103
HOOK_FILE = str(Path(__file__).parents[2] / "posttrain" / "models" / "generation" / "torchvision_cpu_ops.py")


def test_each_images_expanded_tokens_collapse_to_one_placeholder():
    ids = [1, 5, *[IMG] * 4, 7, 8, *[IMG] * 4, 9]
    assert collapse_image_tokens(ids, IMG, 2) == [1, 5, IMG, 7, 8, IMG, 9]
    # two adjacent images are one run, split by the per-image count
    assert collapse_image_tokens([1, *[IMG] * 8, 2], IMG, 2) == [1, IMG, IMG, 2]
    with pytest.raises(ValueError, match=r"runs of lengths \[4, 3\]: they do not split into 2 equal images"):
        collapse_image_tokens([*[IMG] * 4, 1, *[IMG] * 3], IMG, 2)
    with pytest.raises(ValueError, match="do not split into 1 equal images"):
        collapse_image_tokens([1, 2, 3], IMG, 1)


VLLM_LLAVA = {  # vLLM 0.32's LlavaForConditionalGeneration with a CLIP tower (a few names)
    "vision_tower.vision_model.embeddings.class_embedding",
    "vision_tower.vision_model.encoder.layers.0.self_attn.qkv_proj.weight",
    "multi_modal_projector.linear_1.weight",
    "language_model.model.layers.0.self_attn.qkv_proj.weight",
}


def test_a_transformers_5_vision_tower_gets_vllms_vision_model_level():
    # the trainer's names (transformers 5.23) and the ones its checkpoints hold
    assert (vllm_checkpoint_name("model.vision_tower.embeddings.class_embedding", VLLM_LLAVA)
            == "model.vision_tower.vision_model.embeddings.class_embedding")
    assert (vllm_checkpoint_name("vision_tower.encoder.layers.0.self_attn.q_proj.weight", VLLM_LLAVA)
            == "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight")
    # names that already have it, other modules, and a model without the level stay as they are
    for name in ("vision_tower.vision_model.embeddings.class_embedding", "model.multi_modal_projector.linear_1.weight",
                 "model.language_model.layers.0.self_attn.q_proj.weight", "model.my_vision_tower.x"):
        assert vllm_checkpoint_name(name, VLLM_LLAVA) == name
    assert vllm_checkpoint_name("vision_tower.blocks.0.w", {"vision_tower.blocks.0.w"}) == "vision_tower.blocks.0.w"


def test_the_vision_layers_vllm_does_not_build_are_accepted():
    from posttrain.models.generation.vllm_extension import _vllm_param_name

    assert _vllm_param_name("vision_tower.vision_model.encoder.layers.0.self_attn.k_proj.weight", VLLM_LLAVA) == \
        "vision_tower.vision_model.encoder.layers.0.self_attn.qkv_proj.weight"
    # the final norm and the layers after the one the projector reads (vLLM's loader skips them)
    for skipped in ("vision_tower.vision_model.post_layernorm.weight", "vision_tower.vision_model.encoder.layers.1.mlp.fc1.weight"):
        assert _vllm_param_name(skipped, VLLM_LLAVA) == skipped
    assert _vllm_param_name("vision_tower.vision_model.embeddings.patch_embedding.weight", VLLM_LLAVA) is None


def test_which_checkpoints_vllm_cannot_name_itself():
    assert checkpoint_needs_vllm_names({"language_model.lm_head.weight", "vision_tower.embeddings.class_embedding"})
    assert not checkpoint_needs_vllm_names({"vision_tower.vision_model.embeddings.class_embedding",
                                            "language_model.model.embed_tokens.weight"})
    assert not checkpoint_needs_vllm_names({"model.embed_tokens.weight"})


def test_a_generation_batch_carries_the_rows_images_and_training_does_not():
    from posttrain.data.message_log import flatten_message_logs, message_log_source_images

    red, blue = Image.new("RGB", (4, 4), "red"), Image.new("RGB", (4, 4), "blue")
    prompt = {"role": "user", "content": "x", "token_ids": torch.tensor([1, IMG, 2]),
              "pixel_values": torch.zeros(1, 3, 4, 4), "images": [red]}
    two = {**prompt, "token_ids": torch.tensor([IMG, IMG]), "pixel_values": torch.zeros(2, 3, 4, 4), "images": [red, blue]}
    logs = [[prompt], [{"role": "user", "content": "y", "token_ids": torch.tensor([3])}], [two]]
    images = message_log_source_images(logs)
    assert images[0] == [red] and images[1] is None and images[2] == [red, blue]
    assert message_log_source_images([logs[1]]) is None
    assert "images" not in flatten_message_logs(logs, pad_token_id=0)


def test_torchvision_hook_declares_the_two_ops_only_when_torchvision_is_imported():
    """In a fresh interpreter (the hook changes torch's operator registry), the module loaded on its
    own as vLLM's environment has it: installing it imports no torch; importing `torchvision` (here a stand-in module) declares nms and qnms first."""
    code = (
        "import sys, types, importlib.abc, importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('hook', {HOOK_FILE!r})\n"
        "hook = importlib.util.module_from_spec(spec); spec.loader.exec_module(hook)  # as the .pth line does\n"
        "hook.install(); hook.install()\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
        "class Fake(importlib.abc.MetaPathFinder, importlib.abc.Loader):  # torchvision is not installed here\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        return importlib.util.spec_from_loader(name, self) if name == 'torchvision' else None\n"
        "    def create_module(self, spec): return types.ModuleType(spec.name)\n"
        "    def exec_module(self, module): pass\n"
        "sys.meta_path.append(Fake())\n"
        "import torch\n"
        "try:\n    torch.ops.torchvision.nms\n    print('before: yes')\nexcept (AttributeError, RuntimeError):\n"
        "    print('before: no')\n"
        "import torchvision\n"
        "print('after:', torch.ops.torchvision.nms.default._schema, '|', torch.ops.torchvision.qnms.default._schema)\n"
        "print('again:', hook.declare_missing_ops())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["torch imported: False", "before: no"]
    assert lines[2] == ("after: torchvision::nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor | "
                        "torchvision::qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    assert lines[3] == "again: []"

