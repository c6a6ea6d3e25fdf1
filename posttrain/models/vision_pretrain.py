"""Pretraining `tiny-vl`'s vision tower when the preset is built: a CLIP tower that has learnt to see.

A real VLM's tower comes pretrained (CLIP: Radford et al. 2021, arXiv:2103.00020) and LLaVA trains
only the projector and the language model on top of it. A randomly initialised tower has to learn
to see from the answer tokens of whatever task it is trained on, and whether (and when) that
happens depends on the seed and on the CPU's rounding: `shape_count`'s SFT warm start reached 64%
with one seed and stayed near chance (30%) with another, and RL's one bit per sample cannot teach
a tower to see from there (docs/vision.md, "Why a pretrained tower").

So the build pretrains the tower, supervised, on scenes of its own: 0 to 9 shapes (the four kinds
and six colours `data.generators.visual` draws, anywhere in the 64 x 64 image, not on the tasks'
3 x 3 grid), and for every 8 x 8 patch the target is what is centred in it: nothing or a shape's
kind, and its colour (object detection in the manner of per-patch labels; a linear head on the
tower's last hidden states, which are what LLaVA's projector reads). No question, no count and no
text is ever shown; the head is thrown away. ~500 steps of 64 scenes, about 20 s on 2 cores,
once per cache.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

from posttrain.data.generators.visual import COLORS, RADIUS, SHAPES, SIZE, Shape, draw_shapes

PRETRAIN_SCENES = 2048  # distinct training scenes (drawn once; ~1.5 s)
PRETRAIN_STEPS = 500  # measured: per-patch shape kind 89% and colour 99% right on held-out scenes at 400 steps
PRETRAIN_BATCH = 64
PRETRAIN_LR = 3e-3
MAX_SHAPES = 9
COLOR_NAMES = sorted(COLORS)  # the colour labels' order (index + 1)


def random_scene(rng: random.Random) -> list[Shape]:
    """0 to MAX_SHAPES shapes of random kind and colour at random places that do not overlap."""
    shapes: list[Shape] = []
    target = rng.randint(0, MAX_SHAPES)
    for _ in range(200):  # rejection sampling; a crowded scene may end with fewer shapes
        if len(shapes) == target:
            break
        x, y = rng.randint(RADIUS, SIZE - 1 - RADIUS), rng.randint(RADIUS, SIZE - 1 - RADIUS)
        if all((x - s.x) ** 2 + (y - s.y) ** 2 >= (2 * RADIUS + 1) ** 2 for s in shapes):
            shapes.append(Shape(rng.choice(SHAPES), rng.choice(COLOR_NAMES), x, y))
    return shapes


def patch_labels(shapes: list[Shape], patch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per patch (row-major, as the tower's tokens): 0 or 1 + the kind of the shape centred there,
    and 0 or 1 + its colour (indices into SHAPES and COLOR_NAMES)."""
    per_side = SIZE // patch_size
    kind = torch.zeros(per_side * per_side, dtype=torch.long)
    color = torch.zeros(per_side * per_side, dtype=torch.long)
    for shape in shapes:
        patch = (shape.y // patch_size) * per_side + shape.x // patch_size
        kind[patch] = 1 + SHAPES.index(shape.kind)
        color[patch] = 1 + COLOR_NAMES.index(shape.color)
    return kind, color


def pretrain_vision_tower(model: Any, processor: Any, seed: int = 0, steps: int | None = None) -> dict[str, float]:
    """Train `model`'s vision tower in place on per-patch shape detection (module docstring);
    returns the last step's loss and the held-out per-patch accuracies (kind, colour, on patches
    holding a shape's centre). `steps`: default PRETRAIN_STEPS. The global RNG state is left untouched."""
    steps = PRETRAIN_STEPS if steps is None else steps
    tower = model.model.vision_tower
    patch_size = tower.config.patch_size
    assert tower.config.image_size == SIZE, "the scenes are drawn at the tower's image size"
    rng = random.Random(seed)
    scenes = [random_scene(rng) for _ in range(PRETRAIN_SCENES + 256)]  # the last 256 held out
    pixels = processor.image_processor([draw_shapes(s) for s in scenes], return_tensors="pt")["pixel_values"]
    labels = [patch_labels(s, patch_size) for s in scenes]
    kinds, colors = torch.stack([k for k, _ in labels]), torch.stack([c for _, c in labels])
    n_kind, n_color = 1 + len(SHAPES), 1 + len(COLORS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = nn.Linear(tower.config.hidden_size, n_kind + n_color)
        params = [*tower.parameters(), *head.parameters()]
        optimizer = torch.optim.AdamW(params, lr=PRETRAIN_LR, weight_decay=0.0)
        order = torch.Generator().manual_seed(seed)

        def logits(index: torch.Tensor) -> torch.Tensor:
            # LLaVA reads hidden_states[vision_feature_layer=-1] less the class token: the same here.
            return head(tower(pixels[index], output_hidden_states=True).hidden_states[-1][:, 1:])

        tower.train()
        for _ in range(steps):
            index = torch.randint(0, PRETRAIN_SCENES, (PRETRAIN_BATCH,), generator=order)
            out = logits(index)
            loss = (nn.functional.cross_entropy(out[..., :n_kind].reshape(-1, n_kind), kinds[index].reshape(-1))
                    + nn.functional.cross_entropy(out[..., n_kind:].reshape(-1, n_color), colors[index].reshape(-1)))
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
        tower.eval()
        with torch.no_grad():
            held = torch.arange(PRETRAIN_SCENES, len(scenes))
            out = logits(held)
        shape_here = kinds[held] > 0
    kind_acc = (out[..., :n_kind].argmax(-1)[shape_here] == kinds[held][shape_here]).float().mean().item()
    color_acc = (out[..., n_kind:].argmax(-1)[shape_here] == colors[held][shape_here]).float().mean().item()
    for param in tower.parameters():
        param.grad = None
    return {"loss": loss.item(), "kind_accuracy": kind_acc, "color_accuracy": color_acc}
