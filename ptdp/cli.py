"""`ptdp` command line.

Flags are generated from the config dataclasses (ptdp/config.py). A config
file (YAML or TOML, `--config FILE`) may set any of them, either in sections
named like the dataclasses (model, parallel, train, data) or flat; keys are
flag names with or without the leading dashes, or field names. Flags given on
the command line override the file.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import Any, Sequence

from ptdp.config import SECTION_TYPES, Config, ConfigError, flag_fields, validate
from ptdp.data.preprocess import add_preprocess_parser, run_preprocess
from ptdp.data.tokenizer import TokenizerError, add_tokenizer_parser, run_tokenizer_command
from ptdp.inference import add_generate_parser, run_generate_command
from ptdp.interop.convert import add_convert_parser, run_convert_command
from ptdp.perf.calibrate import add_calibrate_parser, run_calibrate_command
from ptdp.perf.plan import add_plan_parser, run_plan_command
from ptdp.perf.timeline import add_schedule_parser, run_schedule_command

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _field_type(annotation: str) -> type:
    kind = annotation.split("|")[0].strip()
    return list if kind.startswith("list[") else _TYPES[kind]


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    groups = {name: parser.add_argument_group(f"{name} settings") for name in SECTION_TYPES}
    for section, f in flag_fields():
        meta = f.metadata
        names = [meta["flag"]] + ([meta["short"]] if "short" in meta else [])
        kwargs: dict[str, Any] = {"dest": f"{section}.{f.name}", "default": argparse.SUPPRESS}
        kind = _field_type(f.type)
        if kind is bool:
            kwargs["action"] = "store_false" if meta.get("negate") else "store_true"
            kwargs["help"] = meta["help"]
        elif kind is list:
            kwargs.update(nargs="+", metavar=meta.get("metavar", "VALUE"), help=meta["help"])
        else:
            kwargs["type"] = kind
            kwargs["metavar"] = meta.get("metavar", {int: "N", float: "X", str: "VALUE"}[kind])
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
                kwargs["metavar"] = "{" + ",".join(meta["choices"]) + "}"
            kwargs["help"] = meta["help"] + ("" if f.default is None else f" (default: {f.default})")
        groups[section].add_argument(*names, **kwargs)


def _load_file(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError([f"--config {path}: no such file"])
    text = file.read_text(encoding="utf-8")
    try:
        if file.suffix.lower() == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            data = tomllib.loads(text)
        elif file.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError([f"--config {path}: use a .yaml, .yml or .toml file"])
    except ConfigError:
        raise
    except Exception as error:  # parser errors carry line and column
        raise ConfigError([f"--config {path}: cannot parse: {error}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: expected a mapping of settings at the top level"])
    return data


def _file_settings(data: dict[str, Any], path: str) -> dict[str, Any]:
    """Map a parsed config file to {"section.field": value}, checking names and types."""
    by_key: dict[str, tuple[str, Any]] = {}
    for section, f in flag_fields():
        for key in (f.name, f.metadata["flag"].lstrip("-").replace("-", "_")):
            by_key[key] = (section, f)
    flat: list[tuple[str, Any]] = []
    for key, value in data.items():
        if key in SECTION_TYPES and isinstance(value, dict):
            flat.extend(value.items())
        else:
            flat.append((key, value))
    settings: dict[str, Any] = {}
    problems = []
    for key, value in flat:
        normal = str(key).lstrip("-").replace("-", "_")
        if normal not in by_key:
            close = difflib.get_close_matches(normal, list(by_key), n=3)
            if "-" in str(key):
                close = [c.replace("_", "-") for c in close]
            problems.append(f"--config {path}: unknown setting {key!r}"
                            + (f"; did you mean {', '.join(close)}?" if close else ""))
            continue
        section, f = by_key[normal]
        kind = _field_type(f.type)
        if normal != f.name and f.metadata.get("negate"):  # a "no-..." flag name: invert
            value = not value if isinstance(value, bool) else value
        if kind is float and isinstance(value, str):
            # YAML 1.1 reads exponent notation without a dot (1e-3) as text.
            try:
                value = float(value)
            except ValueError:
                pass
        if kind is list and isinstance(value, str):  # "0.7 A 0.3 B" as one string
            value = value.split()
        if kind is list and isinstance(value, list):
            value = [str(item) for item in value]  # YAML reads weights as numbers
        optional = "None" in f.type
        ok = (value is None and optional) or (
            isinstance(value, list) if kind is list else
            isinstance(value, bool) if kind is bool else
            (isinstance(value, (int, float)) and not isinstance(value, bool)) if kind is float else
            (isinstance(value, int) and not isinstance(value, bool)) if kind is int else
            isinstance(value, str))
        if not ok:
            problems.append(f"--config {path}: {key} = {value!r} should be of type {kind.__name__}")
            continue
        if "choices" in f.metadata and value not in f.metadata["choices"]:
            problems.append(f"--config {path}: {key} = {value!r} is not one of {f.metadata['choices']}")
            continue
        settings[f"{section}.{f.name}"] = float(value) if kind is float and value is not None else value
    if problems:
        raise ConfigError(problems)
    return settings


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """{"section.field": value} of every setting the user gave, in the
    config file or as a flag (flags win); defaults are not included."""
    settings = _file_settings(_load_file(args.config), args.config) if args.config else {}
    settings.update({k: v for k, v in vars(args).items() if "." in k})
    return settings


def config_from_settings(settings: dict[str, Any]) -> Config:
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTION_TYPES}
    for key, value in settings.items():
        section, name = key.split(".", 1)
        sections[section][name] = value
    return Config.from_dict(sections)


def config_from_args(args: argparse.Namespace) -> Config:
    return config_from_settings(settings_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ptdp", description="PTD-P training of GPT models.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train", help="train a GPT",
        description="Train a GPT with tensor, pipeline and data parallelism. Run directly, it "
                    "starts t·p·d local processes; under torchrun or SLURM it joins their job.")
    train.add_argument("--config", metavar="FILE", help="YAML or TOML file of settings; flags override it")
    _add_config_flags(train)
    add_schedule_parser(commands)
    add_tokenizer_parser(commands)
    add_generate_parser(commands)
    add_convert_parser(commands)
    add_plan_parser(commands)
    add_calibrate_parser(commands)
    add_preprocess_parser(commands)
    return parser


def _check_output_paths(config: Config) -> None:
    """Fail before launching, not after the first iteration, on an unwritable path."""
    problems = []
    for flag_name, path in (("--metrics-file", config.train.metrics_file),
                            ("--timeline", config.train.timeline)):
        if not path:
            continue
        parent = Path(path).resolve().parent
        if not parent.is_dir():
            problems.append(f"{flag_name} {path}: directory {parent} does not exist; create it or "
                            f"choose another path")
        elif Path(path).is_dir():
            problems.append(f"{flag_name} {path} is a directory; give a file path")
    if config.train.timeline and not config.train.timeline.lower().endswith(".png"):
        problems.append(f"--timeline {config.train.timeline}: the picture is a PNG; use a .png path")
    if problems:
        raise ConfigError(problems)


def _reporting_problems(config: Config) -> list[str]:
    """--eval-*, --peak-tflops, --tensorboard-dir, --loss-curve, before launching."""
    tr, problems = config.train, []
    if not isinstance(tr.eval_interval, int) or tr.eval_interval < 0:
        problems.append(f"--eval-interval={tr.eval_interval!r} must be 0 (never) or a positive integer")
    if not isinstance(tr.eval_iters, int) or tr.eval_iters < 1:
        problems.append(f"--eval-iters={tr.eval_iters!r} must be a positive integer")
    if tr.peak_tflops is not None and not tr.peak_tflops > 0:
        problems.append(f"--peak-tflops={tr.peak_tflops!r} must be positive")
    if tr.tensorboard_dir:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            problems.append("--tensorboard-dir needs the tensorboard package: pip install tensorboard")
    if tr.loss_curve:
        parent = Path(tr.loss_curve).resolve().parent
        if not tr.loss_curve.lower().endswith(".png"):
            problems.append(f"--loss-curve {tr.loss_curve}: the picture is a PNG; use a .png path")
        elif not parent.is_dir():
            problems.append(f"--loss-curve {tr.loss_curve}: directory {parent} does not exist")
    return problems


def _checkpoint_problems(config: Config) -> list[str]:
    """--save/--load/--save-interval/--keep-last, checked before launching."""
    from ptdp.train.checkpoint import CheckpointError, check_model_fits, read_metadata, resolve

    tr, problems = config.train, []
    for flag_name, value in (("--save-interval", tr.save_interval), ("--keep-last", tr.keep_last)):
        if value is not None and (not isinstance(value, int) or value < 1):
            problems.append(f"{flag_name}={value!r} must be a positive integer")
        elif value is not None and not tr.save:
            problems.append(f"{flag_name} needs --save DIR")
    if tr.save and Path(tr.save).exists() and not Path(tr.save).is_dir():
        problems.append(f"--save {tr.save} is a file; give a directory")
    if tr.load:
        try:
            directory = resolve(tr.load)
            check_model_fits(read_metadata(directory), config.model, directory)
        except CheckpointError as error:
            problems.append(str(error))
    return problems


def run_train(config: Config, explicit: Sequence[str] = ()) -> int:
    """`explicit`: the settings the user gave ("section.field"); a vocabulary
    size not among them is taken from the tokenizer."""
    from ptdp.data.loader import (DataSettingsError, check_data_settings, check_datasets,
                                  resolve_vocab_size)
    from ptdp.device import resolve_kind
    from ptdp.launch import LOOPBACK, DistEnv, LocalJobFailed, detect_env, launch_local
    from ptdp.train.loop import worker

    env = detect_env()
    problems = check_data_settings(config)
    if problems:
        raise ConfigError(problems)
    try:
        config = resolve_vocab_size(config, explicit="model.vocab_size" in explicit)
    except DataSettingsError as error:
        raise ConfigError([str(error)]) from None
    validate(config, world_size=env.world_size if env is not None else None)
    problems = check_datasets(config) + _checkpoint_problems(config) + _reporting_problems(config)
    if problems:
        raise ConfigError(problems)
    _check_output_paths(config)
    if env is not None:
        worker(env, config)
        return 0
    world = config.parallel.world_size
    try:
        resolve_kind(config.parallel.device, world)
    except RuntimeError as error:
        raise ConfigError([str(error)]) from None
    if world == 1:
        worker(DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1,
                       master_addr=LOOPBACK, master_port=0, source="local"), config)
        return 0
    try:
        launch_local(world, worker, config)
    except LocalJobFailed as failure:
        print(f"ptdp: error: {failure}", file=sys.stderr)
        others = world - 1
        print(f"ptdp: stopped the {others} other rank{'s' if others > 1 else ''}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            settings = settings_from_args(args)
            return run_train(config_from_settings(settings), explicit=list(settings))
        if args.command == "schedule":
            return run_schedule_command(args)
        if args.command == "tokenizer":
            return run_tokenizer_command(args)
        if args.command == "preprocess":
            return run_preprocess(args)
        if args.command == "generate":
            return run_generate_command(args)
        if args.command == "convert":
            return run_convert_command(args)
        if args.command == "plan":
            return run_plan_command(args)
        if args.command == "calibrate":
            return run_calibrate_command(args)
    except (ConfigError, TokenizerError) as error:
        print(f"ptdp: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ptdp: interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
