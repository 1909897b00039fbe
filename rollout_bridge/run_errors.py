"""Clean failures of a training job: one line on stderr and exit status 2, no traceback,
for the mistakes and accidents a user can act on:

- a `--config_path` file that does not exist (`check_config_path`, before draccus opens it),
- a config file with settings this version does not have — written for an older version
  (`unknown_fields_line` rewrites draccus' "fields ... are not valid" message: which file,
  which dotted names, the closest valid names),
- an `output_dir` that cannot be created or written (`check_output_dir`, a probe file),
- a disk that fills up (or a quota, a read-only file system, a file-size limit) during any
  write of the run (`run_cleanly` finds the errno, or tensorstore's text for it, in the
  exception chain; train.py's `run_guard.run_guarded` states it with the disk and what the
  run folder keeps).

Everything else keeps its traceback: it is a bug to report, not a user mistake.
`run_cleanly(main)` is the one place train.py's entry point goes through.
"""

from __future__ import annotations

import difflib
import errno
import os
import re
import sys
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = ["EXIT_USER_ERROR", "UserError", "check_setting", "config_path_argument", "check_config_path", "check_output_dir",
           "storage_error_line", "error_chain", "unknown_fields_line", "run_cleanly"]

EXIT_USER_ERROR = 2   # as argparse and the config checks
CONFIG_FLAG = "--config_path"
PROBE_PREFIX = ".spopp-write-test-"
# errno values that mean "the storage refused the write", with what to tell the user
STORAGE_ERRNOS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EROFS: "the file system is read-only",
    errno.EFBIG: "a file reached the size limit (ulimit -f, or the file system's largest file)",
}
# tensorstore (orbax's array writer) reports a full disk as text, without an errno
STORAGE_MESSAGES = {os.strerror(code): reason for code, reason in STORAGE_ERRNOS.items()}
# draccus: "`loss`: The fields `a`, `b` are not valid for LossSection"
_UNKNOWN_FIELDS = re.compile(r"(?:`(?P<section>[\w.]+)`: )?The fields? (?P<fields>.+?) "
                             r"(?:are|is) not valid for (?P<cls>\w+)")
SUGGESTIONS = 2



def check_setting(ok: bool, name: str, requirement: str, value) -> None:
    """ValueError '<name> must be <requirement>, got <value>' unless ``ok``: the one form of
    a bad config value (the run config's sections, env kinds, rollout engines)."""
    if not ok:
        raise ValueError(f"{name} must be {requirement}, got {value!r}")


class UserError(Exception):
    """A problem with the user's input or machine, stated in one line, printed as
    '<kind>: <message>' (kind: "error", "config error", ...)."""

    def __init__(self, message: str, kind: str = "error"):
        super().__init__(message)
        self.kind = kind


def config_path_argument(argv: Sequence[str]) -> str | None:
    for i, token in enumerate(argv):
        if token == CONFIG_FLAG and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(CONFIG_FLAG + "="):
            return token.split("=", 1)[1]
    return None


def check_config_path(argv: Sequence[str]) -> None:
    """UserError if argv names a --config_path that is not a readable file."""
    path = config_path_argument(argv)
    if path is None:
        return
    if not Path(path).is_file():
        raise UserError(f"{CONFIG_FLAG} {path}: no such file"
                        + ("" if Path(path).parent.is_dir() else
                           f" (the folder {Path(path).parent} does not exist either)"))
    if not os.access(path, os.R_OK):
        raise UserError(f"{CONFIG_FLAG} {path}: not readable")


def check_output_dir(path: str | os.PathLike, field: str = "output_dir") -> Path:
    """Creates `path` if needed and proves it writable with a probe file; UserError
    naming `field` otherwise."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        reason = STORAGE_ERRNOS.get(error.errno, error.strerror or str(error))
        raise UserError(f"{field}={str(path)!r} cannot be written: {reason} "
                        f"({error.filename or folder}); choose another {field}") from None
    return folder


def error_chain(error: BaseException) -> Iterable[BaseException]:
    """``error``, then its causes / contexts, each once."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def storage_error_line(error: BaseException) -> str | None:
    """'<what>: the disk is full (<file>)' if `error` (or its cause) is a refused write."""
    for link in error_chain(error):
        if isinstance(link, OSError) and link.errno in STORAGE_ERRNOS:
            where = f" ({link.filename})" if link.filename else ""
            return f"{STORAGE_ERRNOS[link.errno]}{where}: free space and rerun (--resume " \
                   "continues from the last checkpoint)"
        for text, reason in STORAGE_MESSAGES.items():
            if text in str(link):
                return f"{reason} ({type(link).__name__} while writing): free space and " \
                       "rerun (--resume continues from the last checkpoint)"
    return None


# settings a newer version renamed: the old dotted name -> the new one (named in the hint
# instead of the closest spelling, which can point at the wrong field)
RENAMED = {
    "env.kind": "env.type (or --env <kind>; in YAML env: {type: <kind>})",
    "model.dtype": "model.compute_dtype (model.param_dtype holds the master weights)",
    "advantage.measure": "method.measure",
    "loss.dual_clip": "method.dual_clip",
    "tracker.spo_d_half": "method.d_half (with --method spo)",
    "tracker.spo_rho_min": "method.rho_min (with --method spo)",
    "tracker.spo_rho_max": "method.rho_max (with --method spo)",
    "rollout.group_size": "method.group_size (with --method grpo or rloo)",
    "rollout.max_inflight": "rollout.max_in_flight",
    "rollout.max_seq_len": "rollout.max_total_tokens",
    "advantage.eps": "advantage.whiten_eps",
    # rollout.engine became a choice carrying each engine's own settings
    "rollout.engine_steps_per_call": "rollout.engine.steps_per_call (with --rollout.engine jax)",
    "rollout.prefix_reuse_across_publish": "rollout.engine.prefix_reuse_across_publish (with --rollout.engine jax)",
    "rollout.server_urls": "rollout.engine.server_urls (with --rollout.engine vllm_server)",
    # the program store serves the learner too
    "rollout.engine.program_store": "program_store (top level: the engine's and the learner's programs)",
    "rollout.servers": "rollout.engine (with --rollout.engine vllm_server: its capacity, health_interval_s, "
                       "outage_wait_s, weights_transport and launch)",
    "rollout.servers.python": "rollout.engine.launch.python (with --rollout.engine vllm_server)",
    **{f"rollout.servers.{name}": f"rollout.engine.{name} (with --rollout.engine vllm_server)"
       for name in ("capacity", "health_interval_s", "outage_wait_s", "weights_transport")},
    **{f"rollout.servers.launch{name}": f"rollout.engine.launch{name} (with --rollout.engine vllm_server)"
       for name in ("", ".count", ".gpus_per_server", ".first_gpu", ".gpus", ".extra_args", ".max_restarts",
                    ".ready_timeout_s", ".max_num_seqs", ".cpu_threads", ".kv_cache_gib")},
}
# sections a newer version folded into another: every old dotted name under the first now
# lives under the second
RENAMED_SECTIONS = {"math_tir": ("env", "with --env math_tir")}


def renamed_to(name: str) -> str | None:
    """The new name of a renamed dotted setting ``name`` (with how to use it), or None."""
    if name in RENAMED:
        return RENAMED[name]
    section, _, rest = name.partition(".")
    if section in RENAMED_SECTIONS:
        new, how = RENAMED_SECTIONS[section]
        return f"{new}{'.' + rest if rest else ''} ({how})"
    return None


def check_renamed_flags(argv: Sequence[str]) -> None:
    """UserError naming the new name of a renamed setting given on the command line
    (``--rollout.max_inflight 8``), instead of argparse's bare "unrecognized arguments"."""
    for token in argv:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0]
            new = renamed_to(name)
            if new is not None:
                raise UserError(f"--{name} was renamed to --{new}", "config error")


def _section_classes(config_class: type, section: str | None, class_name: str) -> tuple[type, list[tuple[str, type]]]:
    """The dataclass of `config_class`'s `section` that draccus named `class_name` (for a
    choice section: the chosen choice's class), and the section's (name, class) choices
    (empty unless it is a choice section)."""
    target = config_class()
    for part in (section.split(".") if section else []):
        target = getattr(target, part)
    known = getattr(type(target), "get_known_choices", None)
    choices = list(known().items()) if known is not None else []
    chosen = next((c for _, c in choices if c.__name__ == class_name), type(target))
    return chosen, choices


def unknown_fields_line(message: str, config_path: str | None,
                        config_class: type | None = None) -> str | None:
    """A draccus "fields ... are not valid" message, restated for a config written for
    another version: the file, the dotted names, the closest valid names. None if
    `message` is not that error."""
    match = _UNKNOWN_FIELDS.search(message)
    if match is None:
        return None
    section = match.group("section")
    names = re.findall(r"`([^`]+)`", match.group("fields"))
    dotted = [f"{section}.{n}" if section else n for n in names]
    hints = []
    if config_class is not None:
        import dataclasses

        try:
            chosen, choices = _section_classes(config_class, section, match.group("cls"))
            valid = [f.name for f in dataclasses.fields(chosen)]
        except (AttributeError, TypeError):
            valid, choices = [], []
        for name, full in zip(names, dotted):
            if renamed_to(full) is not None:
                hints.append(f"{full} was renamed to {renamed_to(full)}")
                continue
            owners = [choice for choice, cls in choices if name in {f.name for f in dataclasses.fields(cls)}]
            if owners:
                hints.append(f"{full} is a setting of --{section} {' / '.join(owners)} only")
                continue
            close = difflib.get_close_matches(name, valid, n=SUGGESTIONS)
            if close:
                prefix = f"{section}." if section else ""
                hints.append(f"{full} -> {' or '.join(prefix + c for c in close)}?")
    source = f"config file {config_path}" if config_path else "the command line"
    line = (f"{source} has settings this version does not know: {', '.join(dotted)} "
            "(written for another version of spopp-jax? remove or rename them")
    return line + (f"; closest: {'; '.join(hints)})" if hints else ")")


def run_cleanly(main: Callable[[], Any], stderr: TextIO | None = None) -> int:
    """Runs `main()`; a UserError or a refused write becomes one 'error: ...' line on
    stderr and EXIT_USER_ERROR. Returns 0 on success; other exceptions propagate."""
    stream = stderr if stderr is not None else sys.stderr
    try:
        main()
    except UserError as error:
        print(f"{error.kind}: {error}", file=stream)
        return EXIT_USER_ERROR
    except Exception as error:  # noqa: BLE001 - re-raised unless it is a refused write
        line = storage_error_line(error)
        if line is None:
            raise
        print(f"error: {line}", file=stream)
        return EXIT_USER_ERROR
    return 0
