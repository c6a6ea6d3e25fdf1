"""The `posttrain` command.

    posttrain grpo                                   # the embedded default: GRPO on tiny arithmetic
    posttrain grpo --config my.yaml grpo.max_num_steps=10 policy.optimizer.lr=3e-4
    posttrain sft --print-config                     # show the resolved config and exit
    posttrain init-model --preset tiny --arch llama --out models/tiny
    posttrain convert --checkpoint checkpoints/run/step_100 --out hf_model

Only the standard library is imported at module level, and only pydantic/PyYAML before a job
starts: `--help` and config errors answer in about a second. torch, transformers and ray are
imported by the job's own module, found lazily by name.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Callable, Sequence

# Subcommand -> (module, function) that runs the job; imported only when the job starts.
JOBS: dict[str, tuple[str, str]] = {
    "grpo": ("posttrain.algorithms.grpo", "run"),
    "sft": ("posttrain.algorithms.sft", "run"),
    "dpo": ("posttrain.algorithms.dpo", "run"),
    "rm": ("posttrain.algorithms.rm", "run"),
    "eval": ("posttrain.evals.eval", "run"),
}
ALGO_HELP = {
    "grpo": "GRPO and its variants (DAPO, GSPO, Dr.GRPO) with verifiable rewards",
    "sft": "supervised fine-tuning",
    "dpo": "direct preference optimization",
    "rm": "reward-model training (Bradley-Terry)",
    "eval": "evaluate a model (pass@k, cons@k)",
}
SAMPLE_PROMPT = "12+34="
EXIT_CONFIG_ERROR = 2  # same code argparse uses for bad usage
EXIT_UNAVAILABLE = 1


class Unavailable(Exception):
    """The code a subcommand needs is not there (yet); shown as one line, no traceback."""


def load_target(module_name: str, attr: str, command: str) -> Callable[..., Any]:
    """Import `module_name` and return its `attr`; a missing module raises `Unavailable`.

    Only the target module (or its package) missing counts: a missing dependency deeper inside
    is a real bug and keeps its traceback.
    """
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise Unavailable(f"posttrain {command} is not available yet: module {module_name} does not exist") from None
        raise
    target = getattr(module, attr, None)
    if not callable(target):
        raise Unavailable(f"posttrain {command} is not available yet: {module_name} has no {attr}()")
    return target


# ----------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="RL post-training for language models: GRPO (DAPO, GSPO, Dr.GRPO), SFT, DPO, reward models.",
        epilog="Run `posttrain <command> --help` for the options of one command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    for algo, help_text in ALGO_HELP.items():
        sub = commands.add_parser(
            algo,
            help=help_text,
            description=f"posttrain {algo}: {help_text}.",
            epilog=(
                "Overrides are dotted.key=value pairs applied after the config file, with values "
                "parsed as YAML: grpo.max_num_steps=10 policy.optimizer.lr=3e-4 "
                "policy.generation.stop_strings='[\"</answer>\"]' sft_warmup=null."
            ),
        )
        sub.add_argument(
            "--config",
            metavar="FILE",
            help="YAML config; its `defaults:` files are merged underneath it (default: the embedded tiny example)",
        )
        sub.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
        sub.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, applied last")
        sub.set_defaults(handler=_run_job)

    init = commands.add_parser(
        "init-model",
        help="build a small local model and tokenizer (no download)",
        description="Write a randomly initialised HF model and character-level tokenizer to --out, "
        "then print a greedy sample from it as a smoke check.",
    )
    init.add_argument("--preset", choices=["tiny", "small", "100m"], default="tiny", help="model size (default: tiny)")
    init.add_argument("--arch", choices=["llama", "qwen2", "qwen3_moe", "mixtral"], default="llama",
                      help="architecture (default: llama; qwen3_moe and mixtral are mixtures of experts)")
    init.add_argument("--out", required=True, metavar="DIR", help="output directory")
    init.add_argument("--seed", type=int, default=0, help="initialisation seed (default: 0)")
    init.set_defaults(handler=_init_model)

    convert = commands.add_parser(
        "convert",
        help="convert a training checkpoint (step dir) to a Hugging Face model directory",
        description="Convert a checkpoint step directory into a Hugging Face model directory.",
    )
    convert.add_argument("--checkpoint", required=True, metavar="DIR", help="checkpoint step directory (…/step_N)")
    convert.add_argument("--out", required=True, metavar="DIR", help="output directory")
    convert.set_defaults(handler=_convert)
    return parser


def _version() -> str:
    from posttrain import __version__

    return __version__


# --------------------------------------------------------------------------------------- commands
def _run_job(args: argparse.Namespace) -> int:
    from posttrain.config import config_to_yaml, load_config
    from posttrain.errors import UserError

    try:
        cfg = load_config(args.command, args.config, args.overrides)
        if args.print_config:
            sys.stdout.write(config_to_yaml(cfg))
            return 0
        from posttrain.preflight import preflight

        preflight(cfg)  # model paths, hub ids and data: seconds, before Ray or any worker starts
        module_name, attr = JOBS[args.command]
        run = load_target(module_name, attr, args.command)
        run(cfg)
    except UserError as e:  # config, data or model problem: the message names it; a traceback adds nothing
        print(f"posttrain {args.command}: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return 0


def _init_model(args: argparse.Namespace) -> int:
    build_tiny_model = load_target("posttrain.models.tiny", "build_tiny_model", "init-model")
    path = build_tiny_model(args.out, preset=args.preset, arch=args.arch, seed=args.seed)
    print(f"Wrote {args.arch}-{args.preset} model (seed {args.seed}) to {path}")
    num_params, completion = greedy_sample(path, SAMPLE_PROMPT)
    print(f"{num_params:,} parameters. Greedy sample (untrained) for {SAMPLE_PROMPT!r}: {completion!r}")
    return 0


def greedy_sample(model_dir: Any, prompt: str, max_new_tokens: int = 16) -> tuple[int, str]:
    """Load a saved HF model with transformers and greedily continue `prompt` as a user turn.

    Returns (parameter count, decoded completion). A smoke check that the directory loads and runs.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    encoded = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(
            input_ids=encoded["input_ids"],
            attention_mask=encoded["attention_mask"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    completion = tokenizer.decode(output[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(p.numel() for p in model.parameters()), completion


def _convert(args: argparse.Namespace) -> int:
    from posttrain.errors import UserError

    convert_to_hf = load_target("posttrain.models.policy.checkpoint", "convert_to_hf", "convert")
    try:
        path = convert_to_hf(args.checkpoint, args.out)
    except UserError as e:
        print(f"posttrain convert: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(f"Wrote Hugging Face model to {path if path is not None else args.out}")
    return 0


# ------------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `posttrain` script and `python -m posttrain`; returns the exit code.

    Exit codes: 0 success, 1 the command's code is not available, 2 bad usage or config error,
    130 interrupted.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except Unavailable as e:
        print(str(e), file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        print("posttrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
