"""Check a serve command with vLLM's own code before anything loads.

A dry run should fail where the real start would fail, minus what needs GPUs or weights. Two layers:
  1. vLLM's server parser and its serve-argument checks (unknown flags, bad values, flag combinations);
  2. `AsyncEngineArgs.create_engine_config()`, which builds every config dataclass vLLM starts from (model, cache,
     parallel, speculative with the draft's own model config, scheduler, compilation) and runs their validators,
     e.g. heads divisible by TP, the draft's architecture and EAGLE-3 method, max-model-len against the model.
Layer 2 needs the models' config.json files. A published checkpoint that is not on this machine is replaced by a
config-only stand-in (its published shape, no weights). What a CPU cannot tell is listed in the report.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass, field
from pathlib import Path

from kimi_eagle.serve.command import CommandError, ServeCommand

STAND_IN_TARGETS = ("moonshotai/Kimi-K2.5",)
STAND_IN_DRAFTS = ("lightseekorg/kimi-k2.5-eagle3",)
# What vLLM's CPU platform replaces with its own values in `check_and_update_config` (vllm/platforms/cpu.py).
CPU_PLATFORM_OVERRIDES = ("KV block size and attention backend", "CUDA graphs and the compilation mode",
                          "async scheduling", "dual-batch overlap")
_DEEPSEEK_FAMILY = {"deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25"}
_CONFIG_ERRORS = (ValueError, TypeError, RuntimeError, AssertionError, OSError, ImportError)


@dataclass
class ValidationReport:
    """What a dry run checked with vLLM's own code, and what it could not check on this machine."""

    checked: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    vllm_warnings: list[str] = field(default_factory=list)

    def render(self) -> str:
        from vllm import __version__

        lines = [f"Validated with vLLM {__version__}'s own code:", *(f"  ok  {line}" for line in self.checked)]
        if self.not_checked:
            lines += ["Not validated here:", *(f"  --  {line}" for line in self.not_checked)]
        if self.vllm_warnings:
            lines += ["vLLM's warnings while building the config (on this machine):",
                      *(f"  !   {line}" for line in self.vllm_warnings)]
        return "\n".join(lines)


def validate_with_vllm(command: ServeCommand, *, engine_config: bool = True) -> ValidationReport:
    """Check the command with vLLM's parser and, when `engine_config`, with its config classes: an unknown flag, a
    bad value or an impossible combination fails here (CommandError), not after minutes of loading."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    make_arg_parser, validate_parsed_serve_args = _serve_argument_checks()

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm"))
    usage = io.StringIO()  # argparse prints its whole usage (hundreds of lines) before the one line that matters
    try:
        with redirect_stderr(usage):
            namespace = parser.parse_args(command.argv[3:])  # drop `python -m module`
    except SystemExit:
        reason = [line.removeprefix("vllm: error: ") for line in usage.getvalue().splitlines()
                  if line.startswith("vllm: error: ")]
        raise CommandError(f"vLLM rejects the flags of this profile: {'; '.join(reason) or usage.getvalue()}") \
            from None
    try:
        validate_parsed_serve_args(namespace)
    except (TypeError, ValueError) as exc:
        raise CommandError(f"vLLM rejects this combination of flags: {exc}") from None
    report = ValidationReport(checked=["every flag, by vLLM's server parser and its serve-argument checks"])
    if engine_config:
        _check_engine_config(namespace, report, command.env)
    return report


def _serve_argument_checks():
    """vLLM's server parser and its serve-argument checks: `entrypoints/launchers/cli_args.py` in 0.32, moved to
    `entrypoints/common/cli_args.py` in 0.33 (where `kimi-eagle serve` died with ModuleNotFoundError)."""
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    except ModuleNotFoundError:
        from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    return make_arg_parser, validate_parsed_serve_args


def _check_engine_config(namespace: object, report: ValidationReport, env: dict[str, str]) -> None:
    import importlib.util
    import tempfile

    from vllm.engine.arg_utils import AsyncEngineArgs

    engine_args = AsyncEngineArgs.from_cli_args(namespace)
    with tempfile.TemporaryDirectory(prefix="kimi-eagle-stand-in-") as scratch:
        renames: dict[str, str] = {}
        target = _config_source(engine_args.model, Path(scratch) / "target", "target", report, renames)
        if target is None:
            report.not_checked.append("the engine config: it needs the target's config.json")
            return
        engine_args.model = target
        spec = engine_args.speculative_config
        if spec and spec.get("model"):
            draft = _config_source(spec["model"], Path(scratch) / "draft", "draft", report, renames)
            if draft is None:
                engine_args.speculative_config = None
                report.not_checked.append("the speculative config: it needs the draft's config.json")
            else:
                engine_args.speculative_config = {**spec, "model": draft}
        if engine_args.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            # ParallelConfig insists on importing Ray for this backend; everything else about it is the same.
            engine_args.distributed_executor_backend = "mp"
            report.not_checked.append("the Ray cluster: Ray is not installed here, so the parallel config was built "
                                      "with the `mp` backend in its place")
        with _environment_restored(env), _vllm_warnings_collected(engine_args) as warnings:
            try:
                vllm_config = engine_args.create_engine_config()
            except _CONFIG_ERRORS as exc:
                message = _config_error_message(exc)
                for stand_in, name in renames.items():
                    message = message.replace(stand_in, name)
                raise CommandError(f"vLLM's config classes reject this profile: {message}") from None
        report.vllm_warnings = list(dict.fromkeys(warnings))
    _refuse_eagle3_with_pipeline_parallel(vllm_config)
    par, spec_config = vllm_config.parallel_config, vllm_config.speculative_config
    speculative = (f"speculative ({spec_config.method}, {spec_config.num_speculative_tokens} tokens, draft "
                   f"{spec_config.draft_model_config.architecture})" if spec_config else "no speculation")
    if spec_config is not None and spec_config.num_speculative_tokens_per_batch_size:
        report.checked.append(_check_schedule(vllm_config))
    report.checked.append(
        f"the engine config vLLM starts from (`create_engine_config`): model ({vllm_config.model_config.architecture}, "
        f"{vllm_config.model_config.quantization or 'unquantised'}, max-model-len "
        f"{vllm_config.model_config.max_model_len}), parallel (TP {par.tensor_parallel_size}, PP "
        f"{par.pipeline_parallel_size}, DP {par.data_parallel_size}, expert parallel "
        f"{'on' if par.enable_expert_parallel else 'off'}, executor {_executor(par)}), {speculative}, cache, "
        "scheduler")
    report.not_checked += [
        "what only a GPU run shows: CUDA kernels for this quantization and attention, memory (estimate it with "
        "`kimi-eagle sizing`), NCCL; and the checkpoint's tensors (no weight file is opened)",
        f"for a GPU deployment, what vLLM's CPU platform set its own way here: {', '.join(CPU_PLATFORM_OVERRIDES)}",
    ]


def _check_schedule(vllm_config: object) -> str:
    """vLLM reads the schedule only when its scheduler starts: build its lookup the way the scheduler will."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    spec = vllm_config.speculative_config
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    try:
        lookup = build_dynamic_sd_schedule_lookup(spec.num_speculative_tokens_per_batch_size, max_num_seqs,
                                                  spec.num_speculative_tokens)
    except ValueError as exc:
        raise CommandError(f"num_speculative_tokens_per_batch_size {spec.num_speculative_tokens_per_batch_size}: "
                           f"vLLM's scheduler would refuse it: {exc}") from None
    ranges, start = [], 1
    for size in range(2, max_num_seqs + 2):
        if size > max_num_seqs or lookup[size] != lookup[start]:
            sizes = f"{start}-{size - 1}" if size - 1 > start else f"{start}"
            ranges.append(f"{sizes}: k={lookup[start]}")
            start = size
    return (f"the dynamic speculation schedule, as vLLM's scheduler will expand it (`build_dynamic_sd_schedule_lookup`"
            f", up to max-num-seqs {max_num_seqs}): batch size {', '.join(ranges)}")


def _config_error_message(exc: BaseException) -> str:
    """The validator's own words, without pydantic's input dump and help link."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and hasattr(exc, "title"):  # pydantic's ValidationError
        return f"{exc.title}: " + "; ".join(e["msg"].removeprefix("Value error, ") for e in errors())
    return str(exc)


def _config_source(ref: str, stand_in_dir: Path, role: str, report: ValidationReport,
                   renames: dict[str, str]) -> str | None:
    """A folder vLLM can read the config of: the local checkpoint, or a config-only stand-in of a published one."""
    if (Path(ref) / "config.json").is_file():
        report.checked.append(f"the {role}'s config.json, read from {ref}")
        return ref
    if ref not in (STAND_IN_TARGETS if role == "target" else STAND_IN_DRAFTS):
        report.not_checked.append(f"the {role} {ref}: not a local folder with a config.json, and no stand-in for it")
        return None
    try:
        write_config_stand_in(ref, stand_in_dir)
    except CommandError as exc:
        report.not_checked.append(f"the {role} {ref}: {exc}")
        return None
    if role == "target":
        report.checked.append(f"the {role} {ref} through a config-only stand-in: its published shape "
                              "(serve/sizing.py), with the tiny fixture's tokenizer and vision config")
        report.not_checked.append(f"the {role}'s own tokenizer, vision config and weights")
    else:
        report.checked.append(f"the {role} {ref} through a config-only stand-in: the shape of its training config "
                              "(serve/sizing.py)")
        report.not_checked.append(f"the {role}'s own config.json and weights")
    renames[str(stand_in_dir)] = ref
    return str(stand_in_dir)


def write_config_stand_in(ref: str, folder: Path) -> None:
    """A config-only folder (no weights) standing in for a published checkpoint that is not on this machine.

    The Kimi-K2.5 stand-in is the published text config in the tiny fixture's wrapper, whose tokenizer and vision
    config it borrows (vLLM's Kimi-K2.5 config needs a tokenizer; the real one is remote code)."""
    from kimi_eagle.serve.sizing import KIMI_K25_EAGLE3_DRAFT_CONFIG, KIMI_K25_TEXT_CONFIG

    if ref in STAND_IN_DRAFTS:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(KIMI_K25_EAGLE3_DRAFT_CONFIG, indent=2))
        return
    if ref not in STAND_IN_TARGETS:
        raise CommandError(f"no stand-in for {ref}: known are {', '.join(STAND_IN_TARGETS + STAND_IN_DRAFTS)}")
    from kimi_eagle.fixtures.pair_spec import TARGET_DIR

    borrowed = ("config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json")
    if not all((TARGET_DIR / name).is_file() for name in borrowed):
        raise CommandError(f"its stand-in borrows the tiny fixture at {TARGET_DIR}, which is missing")
    folder.mkdir(parents=True, exist_ok=True)
    for name in borrowed[1:]:
        (folder / name).write_bytes((TARGET_DIR / name).read_bytes())
    # The media token ids stay the fixture's: they must exist in the borrowed tokenizer.
    config = json.loads((TARGET_DIR / "config.json").read_text())
    config["text_config"] = dict(KIMI_K25_TEXT_CONFIG)
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def _refuse_eagle3_with_pipeline_parallel(vllm_config: object) -> None:
    """vLLM 0.32's DeepseekV2/V3 model (Kimi-K2.5's language model) keeps the aux hidden states in a local list and
    returns only `hidden_states` and `residual` from a pipeline stage that is not the last
    (vllm/model_executor/models/deepseek_v2.py, `DeepseekV2Model.forward`): with PP > 1 the draft receives the aux
    states of the last stage only, not the three it was trained on."""
    spec = vllm_config.speculative_config
    model_type = getattr(vllm_config.model_config.hf_text_config, "model_type", "")
    if (spec is not None and spec.method == "eagle3" and vllm_config.parallel_config.pipeline_parallel_size > 1
            and model_type in _DEEPSEEK_FAMILY):
        raise CommandError("an EAGLE-3 draft with pipeline parallelism loses the aux hidden states of the earlier "
                           "stages in vLLM 0.32 (DeepseekV2Model.forward): use tensor parallelism across the GPUs "
                           "instead (--tensor-parallel-size N --pipeline-parallel-size 1)")


def _executor(parallel_config: object) -> str:
    backend = parallel_config.distributed_executor_backend
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", str(backend))
    # vLLM's CPU platform turns `uni` into `mp` unless the profile's env turns V1 multiprocessing off: say which won.
    return {"uni": "uni, the worker inside the engine core process",
            "mp": "mp, a worker process per rank"}.get(name, name)


@contextmanager
def _environment_restored(env: dict[str, str]) -> Iterator[None]:
    # The config is built under the profile's env (vLLM's CPU platform reads some of it, e.g. whether V1
    # multiprocessing is on). vLLM's CPU platform writes worker settings into os.environ while it builds the config;
    # the server we start later inherits our environment, so put it back as it was.
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(level=logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


@contextmanager
def _vllm_warnings_collected(engine_args: object) -> Iterator[list[str]]:
    """vLLM's warnings for the report instead of its INFO lines on our stdout."""
    from vllm.logger import configure_logging_if_needed

    # Configure vLLM's logging now, so that create_engine_config does not reconfigure it under our handler.
    configure_logging_if_needed(engine_args.create_logging_config())
    vllm_logger = logging.getLogger("vllm")
    collected: list[str] = []
    saved = vllm_logger.handlers[:]
    vllm_logger.handlers = [_Collect(collected)]
    try:
        yield collected
    finally:
        vllm_logger.handlers = saved
