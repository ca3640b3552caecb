"""The static checks of `doctor`, run before the engine starts: refusals stop `serve`."""

from __future__ import annotations

import errno
import re
import socket
import sys
import urllib.parse
from pathlib import Path

from kimi_eagle.serve.command import ServeCommand
from kimi_eagle.serve.integrity import check_weight_folder

KV_CACHE_BYTES_FLAG = "--kv-cache-memory-bytes"
GIB = 1 << 30
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as vLLM resolves from a model hub


def weights_are_whole(command: ServeCommand) -> bool:
    """True when the weight files of the target and the draft can be loaded whole. A truncated or re-labelled file
    is refused here, by name, instead of failing minutes into loading (or loading as garbage)."""
    problems = [p for folder in (command.target, command.draft) if folder for p in check_weight_folder(folder)]
    if problems:
        print("pre-flight: the weights on disk cannot be loaded whole, so no engine was started:\n"
              + "\n".join(f"- {p.render()}" for p in problems), file=sys.stderr)
    return not problems


def kv_cache_fits(command: ServeCommand) -> bool:
    """True unless the KV cache asked for in bytes cannot fit in this machine's memory. On a CPU vLLM reserves it on
    the NUMA node of the first core it may use, and fails the start, after loading and compiling, when the node has
    less available (`determine_available_memory` in vllm/v1/worker/cpu_worker.py): the same measure, said first."""
    requested = flag_value(command.argv, KV_CACHE_BYTES_FLAG)
    if requested is None:
        return True
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return True  # on a GPU vLLM checks it against the device's memory itself, after loading
    from vllm.utils.argparse_utils import human_readable_int
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    node = get_allowed_cpu_list()[0].numa_node
    available = get_memory_node_info(node).available_memory
    needed = human_readable_int(requested)
    if needed <= available:
        return True
    print(f"pre-flight: the KV cache needs {needed / GIB:.2f} GiB ({KV_CACHE_BYTES_FLAG} "
          f"{requested}) and NUMA node {node} has {available / GIB:.2f} GiB available: free memory (another "
          f"server?) or give a smaller {KV_CACHE_BYTES_FLAG} after `--`", file=sys.stderr)
    return False


def address_is_free(command: ServeCommand) -> bool:
    """True unless something listens on the address the server is to bind. Otherwise the other server answers
    /health while this one imports, `serve` prints Ready for it, and the new server then dies binding the port
    ("Address already in use"). Bound as uvicorn binds (SO_REUSEADDR), so a port in TIME_WAIT is free."""
    address = urllib.parse.urlsplit(command.url)
    host, port = address.hostname or "127.0.0.1", address.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return True  # vLLM's own bind says what else is wrong with the address
            print(f"pre-flight: {host}:{port} is already in use (another server, a `make serve` still running?), "
                  "so no engine was started: stop it, or give another port (`kimi-eagle serve --port N`, "
                  "`make serve ARGS=\"--port N\"`)", file=sys.stderr)
            return False
    return True


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in argv (vLLM's parser keeps the last one too)."""
    value = None
    for word, following in zip(argv, [*argv[1:], None]):
        if word == flag:
            value = following
        elif word.startswith(f"{flag}="):
            value = word.partition("=")[2]
    return value


def model_reference_problem(role: str, ref: str) -> str | None:
    """Why vLLM could not load `ref` as the `role` ("target", "draft"), or None: a local folder, or a hub name
    (owner/name) it downloads. Anything else vLLM takes for a hub name too, and fails on after start-up with
    "Repo id must be in the form 'repo_name' or 'namespace/repo_name'", a message that names neither the profile
    nor the path."""
    # No `~` expansion: vLLM does none either, and the checks below read the path as given.
    path = Path(ref)
    if path.is_dir() or (not path.exists() and HUB_NAME.fullmatch(ref)):
        return None
    what = "is a file, not a checkpoint folder" if path.exists() else "does not exist"
    return (f"the {role} {ref} {what}, and is not a hub name (owner/name) that vLLM could download: point the "
            f"profile's `{role}` (or `kimi-eagle serve --{role} DIR`) at the folder that holds its config.json")


def preflight(command: ServeCommand) -> bool:
    """True when the pair may be served. Prints every finding that is not OK (warnings and refusals for vLLM)."""
    from kimi_eagle.checks import run_static_checks
    from kimi_eagle.checks.diagnosis import check_target_alone

    problems = [problem for role, ref in (("target", command.target), ("draft", command.draft))
                if ref is not None and (problem := model_reference_problem(role, ref))]
    if problems:
        print("pre-flight: no engine was started:\n" + "\n".join(f"- {p}" for p in problems), file=sys.stderr)
        return False
    if not (weights_are_whole(command) and kv_cache_fits(command)):
        return False
    target = Path(command.target)
    draft = Path(command.draft) if command.draft is not None else None
    if draft is not None and not draft.exists():  # a hub name (model_reference_problem let it through)
        print(f"pre-flight: {command.draft} is not a local folder: vLLM downloads it; the draft checks are "
              "skipped (run `kimi-eagle doctor` on the downloaded folder)", file=sys.stderr)
        draft = None
    if draft is None:
        # the target's own checks (a tensor stored in two shards) hold without a draft too
        return _judge(check_target_alone(target) if target.is_dir() else [], "this target")
    if not target.is_dir():
        # a hub name: vLLM downloads it; the checks against it need the files here
        print(f"pre-flight: {command.target} is not a local folder: the checks against the target are skipped",
              file=sys.stderr)
    return _judge(run_static_checks(draft, target if target.is_dir() else None), "this EAGLE-3 draft")


def _judge(findings: list, subject: str) -> bool:
    """Print the warnings and refusals for vLLM; True when there is no refusal."""
    from kimi_eagle.checks import Severity, refusal_message

    findings = [f for f in findings if f.applies_to("vllm")]
    for f in findings:
        if f.severity == Severity.WARNING:
            print(f"pre-flight warning [{f.code}] {f.title}: found {f.found}; expected {f.expected}. Fix: {f.fix}",
                  file=sys.stderr)
    message = refusal_message(findings, engine="vllm", subject=subject)
    if message:
        print(message, file=sys.stderr)
        return False
    return True
