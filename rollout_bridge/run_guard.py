"""What a training job checks before it touches its run folder, and how it ends when it
cannot finish: one line saying what is kept and how to continue.

`prepare_run(cfg, paths)` (first thing `train.py` does with a run folder):

1. takes the folder's run lock (`run_lock.RunLock`): a second job on one ``output_dir`` is
   refused with one line naming the holder; a lock left by a killed job is taken over;
2. with ``--resume``, picks the step to resume from before anything is rewritten: the
   newest checkpoint whose files match their checksums (a damaged newer one is named in
   one line) or ``--resume_step``; and compares the settings the run was made with (that
   checkpoint's config, else ``run_config.json`` of the first start) with the settings
   given now. A difference is refused with one line listing it, and the warm start, the
   prior and the checkpoints stay as they are. So is a ``--keep_checkpoints`` that orbax's
   next save would delete kept steps by (the folder holds more than it + 1: a run made with
   more kept checkpoints).
   Steps newer than the chosen one are moved to ``<output_dir>/checkpoints_set_aside/``
   (kept, out of orbax's way). The settings hold ``model.path``, not what is in it: the
   content of the policy the run started from (``evaluation_cache.policy_digest`` of
   ``model.path``, kept in ``start_policy.json``) is compared too, and a folder whose files
   changed since (a re-export, an updated shipped asset) is refused in one line: the
   checkpoints were trained from the other weights. A run started before that record was
   kept resumes with one line saying the start is not checked;
3. without ``--resume`` on a folder without checkpoints, records the settings in
   ``run_config.json`` for a later ``--resume`` to check, and the starting policy's content
   in ``start_policy.json`` (so does a ``--resume`` that finds no checkpoint: RL starts
   afresh from what is at ``model.path`` now);
4. removes half-written HF export folders a stopped job left (``.hf_model.partial-*``).

`run_guarded(main)` replaces `run_errors.run_cleanly` as train.py's entry point: SIGINT
(Ctrl-C) and SIGTERM raise `RunInterrupted` in the main thread, so they arrive between
Python bytecodes, never inside XLA's compiler threads; the job's ``finally`` blocks run;
then one line says what the run folder keeps and the command that continues it, and the
process ends with ``os._exit`` (128 + signal number) without the interpreter's teardown,
which could run while XLA or orbax threads still work (a Ctrl-C during compilation
segfaulted there). After the first signal, anything third-party code prints goes to
``<output_dir>/interrupt.log``; a second signal ends the process at once. A run stopped
for non-finite updates or a non-finite state, or by an unreadable checkpoint, ends the
same way with one line. So does a refused write (a full disk, a quota, a read-only file
system, a file-size limit) anywhere in the job: the line names the reason, what was being
written, the file system's mount point with its free space, what the run folder keeps and
the command that continues; the full error and what orbax's worker threads reported about
it (`spopp_jax.checkpoint.failure_details`) go to ``<output_dir>/storage_error.log`` (or,
with no room even for that, to a file in the temporary folder), named at the line's end.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from rollout_bridge.run_lock import RunLock
from rollout_bridge.run_errors import EXIT_USER_ERROR, UserError, error_chain, run_cleanly

RUN_CONFIG_FILE = "run_config.json"
START_POLICY_FILE = "start_policy.json"
SET_ASIDE_FOLDER = "checkpoints_set_aside"
INTERRUPT_LOG = "interrupt.log"
STORAGE_ERROR_LOG = "storage_error.log"
EXIT_FAILED = 1
SHOWN_DIFFERENCES = 6

_run: dict[str, Any] = {"root": None, "lock": None}


class RunInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (``signum``)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------ before any work
def complete_steps(checkpoints: Path) -> list[int]:
    """Finalized orbax step folders (digit names), ascending."""
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.is_dir() and p.name.isdigit())


def prepare_run(cfg, paths, log: Callable[[str], None] = _log) -> None:
    """Lock the run folder, then check (and with ``--resume`` prepare) what it holds; see
    the module docstring. UserError on a refused start, with nothing in the folder changed."""
    lock = RunLock(paths.root, log).acquire()
    _run.update(root=Path(paths.root), lock=lock)
    try:
        check_resume(cfg, paths, log)
    except BaseException:
        lock.release()
        raise
    remove_interrupted_exports(Path(paths.root), log)


def remove_interrupted_exports(root: Path, log: Callable[[str], None] = _log) -> int:
    """Removes the staging folders of HF exports a killed job left (``.<name>.partial-*``,
    `spopp_jax.export.export_model`); safe under the run lock: no other job exports here."""
    import shutil

    staged = [p for p in (*root.glob(".*.partial-*"), *root.glob("exports/.*.partial-*")) if p.is_dir()]
    for folder in staged:
        shutil.rmtree(folder, ignore_errors=True)
    if staged:
        log(f"removed {len(staged)} export folder(s) a stopped job left half-written: "
            + ", ".join(p.name for p in staged))
    return len(staged)


def _saved_settings(paths, step: int | None) -> tuple[dict | None, str]:
    from spopp_jax.export import read_step_config

    if step is not None:
        folder = paths.checkpoints / str(step)
        return read_step_config(folder), f"checkpoint {folder}"
    record = Path(paths.root) / RUN_CONFIG_FILE
    if record.is_file():
        return json.loads(record.read_text()), str(record)
    return None, ""


def _refuse_pruning(cfg, paths, kept: list[int]) -> None:
    """Orbax keeps the newest ``keep_checkpoints`` steps of the folder at every save, the
    ones already there included: a resume with fewer than the folder holds (a run made with
    ``--keep_checkpoints 21`` continued with the default 2) would delete the others. One
    step more than ``keep_checkpoints`` is what a job killed between a save and orbax's
    deletion of the oldest leaves, so that is resumed as the run would have gone on."""
    if len(kept) > cfg.keep_checkpoints + 1:
        lost = kept[:len(kept) - cfg.keep_checkpoints]
        raise UserError(f"--resume: {paths.checkpoints} holds {len(kept)} checkpoints (steps {kept}); with "
                        f"--keep_checkpoints {cfg.keep_checkpoints} the next save would delete steps {lost}. "
                        f"Nothing was changed; resume with --keep_checkpoints {len(kept)} (or more) to keep them")


def _start_policy(cfg) -> dict | None:
    """The policy the run starts from (the warm start, when on, is trained from it):
    ``model.path`` and its content (None: the tiny model, which code makes from the keyed
    model settings and the tasks)."""
    from rollout_bridge.evaluation_cache import policy_digest

    if cfg.model.path is None:
        return None
    return {"folder": str(cfg.model.path), "digest": policy_digest(cfg.model.path)}


def record_start_policy(cfg, paths) -> None:
    """Keep the starting policy's content in ``start_policy.json`` (before any checkpoint is
    trained from it) for ``--resume`` to compare (`check_start_policy`)."""
    from rollout_bridge.atomic_files import write_json_atomic

    start = _start_policy(cfg)
    record = Path(paths.root) / START_POLICY_FILE
    if start is None:
        record.unlink(missing_ok=True)
    else:
        write_json_atomic(record, start)


def check_start_policy(cfg, paths, log: Callable[[str], None] = _log) -> None:
    """UserError when the files at ``model.path`` are not those the run's checkpoints were
    trained from (``start_policy.json``), or when that record is damaged; a run without the
    record resumes, said in one line."""
    record = Path(paths.root) / START_POLICY_FILE
    if cfg.model.path is None:
        return
    if not record.is_file():
        log(f"resume: {paths.root} keeps no record of the starting policy's content (a run started before "
            f"it was kept): the files in {cfg.model.path} are not checked")
        return
    try:
        recorded = json.loads(record.read_text())["digest"]
    except (OSError, ValueError, TypeError, KeyError):
        raise UserError(f"--resume: {record} is damaged (not the record train.py writes). Nothing was changed; "
                        "restore it, or remove it to resume without checking the starting policy's files") from None
    if recorded != _start_policy(cfg)["digest"]:
        raise UserError(f"--resume: the starting policy's files in {cfg.model.path} changed since the run in "
                        f"{paths.root} started (its checkpoints were trained from other weights). Nothing was "
                        "changed; point --model.path at the original weights, or choose a new --output_dir")


def check_resume(cfg, paths, log: Callable[[str], None] = _log) -> int | None:
    """The checkpoint step ``--resume`` continues from (None: none, RL starts afresh)."""
    from rollout_bridge.run_folder import checkpoint_key
    from rollout_bridge.atomic_files import write_json_atomic
    from spopp_jax.checkpoint import config_differences
    from spopp_jax.checkpoint_integrity import find_damage

    requested = getattr(cfg, "resume_step", None)
    steps = complete_steps(paths.checkpoints)
    key = checkpoint_key(cfg)
    if not cfg.resume:
        if requested is not None:
            raise UserError(f"--resume_step {requested} needs --resume")
        if not steps:
            write_json_atomic(Path(paths.root) / RUN_CONFIG_FILE, key)
            record_start_policy(cfg, paths)
        return None
    damaged: list[tuple[int, str]] = []
    chosen = None
    if requested is not None:
        if requested not in steps:
            raise UserError(f"--resume_step {requested}: no such checkpoint in {paths.checkpoints} "
                            f"(it has {steps or 'none'})")
        why = find_damage(paths.checkpoints / str(requested))
        if why is not None:
            raise UserError(f"--resume_step {requested}: checkpoint {paths.checkpoints / str(requested)} "
                            f"is damaged ({why}); pick another of {steps}")
        chosen = requested
    else:
        for step in reversed(steps):
            why = find_damage(paths.checkpoints / str(step))
            if why is None:
                chosen = step
                break
            damaged.append((step, why))
        if steps and chosen is None:
            raise UserError(f"--resume: every checkpoint in {paths.checkpoints} is damaged ("
                            + "; ".join(f"step {s}: {w}" for s, w in damaged) + ")")
    saved, source = _saved_settings(paths, chosen)
    if saved is not None:
        diffs = config_differences(saved, key)
        if diffs:
            shown = diffs[:SHOWN_DIFFERENCES] + ([f"... {len(diffs) - SHOWN_DIFFERENCES} more"]
                                                 if len(diffs) > SHOWN_DIFFERENCES else [])
            raise UserError(f"--resume: {paths.root} was made with other settings than these "
                            f"({source}): {'; '.join(shown)}. Nothing was changed; resume with "
                            "that run's settings, or choose a new --output_dir")
    if chosen is None:
        record_start_policy(cfg, paths)   # no checkpoint yet: RL starts from what is there now
    else:
        check_start_policy(cfg, paths, log)
    newer = [s for s in steps if chosen is not None and s > chosen]
    _refuse_pruning(cfg, paths, [s for s in steps if s not in newer])
    if newer:
        aside = Path(paths.root) / SET_ASIDE_FOLDER
        aside.mkdir(exist_ok=True)
        for step in newer:
            target = aside / str(step)
            if target.exists():
                target = aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
            os.replace(paths.checkpoints / str(step), target)
        why = {s: w for s, w in damaged}
        reasons = "; ".join(f"step {s}: {why[s]}" if s in why else f"step {s}: newer than --resume_step"
                            for s in newer)
        log(f"resume: from checkpoint step {chosen}; set aside in {aside}: {reasons}")
    return chosen


# ------------------------------------------------------------------ ending
def _kept(root: Path) -> str:
    parts = []
    if (root / "warmstart_model" / "warmstart.json").is_file():
        parts.append("the warm start")
    elif (root / "warmstart_checkpoints").is_dir():
        parts.append("the warm start's last SFT epoch")
    if (root / "prior.json").is_file():
        parts.append("the prior")
    steps = complete_steps(root / "checkpoints")
    if steps:
        parts.append(f"checkpoints up to step {steps[-1]}")
    if (root / "metrics.jsonl").is_file() and steps:
        parts.append("the metrics of those updates")
    if (root / "summary.json").is_file():
        parts.append("the final summary")
    return ", ".join(parts) if parts else "nothing yet"


def resume_command(argv: list[str] | None = None) -> str:
    argv = list(sys.argv if argv is None else argv)
    script = argv[0] if argv else "train.py"
    args = [a for a in argv[1:] if a not in ("--resume", "--resume=true", "--resume=True")]
    if "--resume" in argv[1:]:
        index = argv[1:].index("--resume")
        if index + 1 < len(argv[1:]) and argv[1:][index + 1] in ("true", "True"):
            args.remove(argv[1:][index + 1])
    return shlex.join(["python", script, *args, "--resume"])


class _StorageEnding(BaseException):
    """A refused write (full disk, quota, read-only) on its way past `run_cleanly` to
    `ending_line`, which names the disk and what the run folder keeps."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    device = path.stat().st_dev
    while path.parent != path and path.parent.stat().st_dev == device:
        path = path.parent
    return path


def _megabytes(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def _disk(root: Path) -> str:
    """'<mount point> has <free> free of <size>': the file system holding ``root``."""
    try:
        stats = os.statvfs(root)
        return (f"{_mount_point(root)} has {_megabytes(stats.f_bavail * stats.f_frsize)} free of "
                f"{_megabytes(stats.f_blocks * stats.f_frsize)}")
    except OSError:
        return str(root)


def _write_details(root: Path, error: BaseException) -> Path | None:
    """The full error and what orbax's threads reported, in <root>/STORAGE_ERROR_LOG, or
    when the full disk refuses that too, in the temporary folder; None if neither works."""
    import traceback

    from spopp_jax.checkpoint import failure_details

    text = "".join(traceback.format_exception(error)) + "".join(
        f"\n--- reported by a checkpoint worker thread ---\n{d}" for d in failure_details())
    import tempfile

    for path in (root / STORAGE_ERROR_LOG,
                 Path(tempfile.gettempdir()) / f"spopp-{STORAGE_ERROR_LOG[:-4]}-{os.getpid()}.log"):
        try:
            with open(path, "a") as log:
                log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')}\n{text}\n")
            return path
        except OSError:
            with contextlib.suppress(OSError):
                if path.is_file() and path.stat().st_size == 0:
                    path.unlink()
    return None


def _storage_line(error: BaseException) -> str | None:
    """One line for a refused write: the reason, what was being written, the disk, what
    the run folder keeps and the command that continues it."""
    from rollout_bridge.run_errors import STORAGE_ERRNOS, storage_error_line
    from spopp_jax.checkpoint import CheckpointWriteError

    REMEDIES = {STORAGE_ERRNOS[errno.EROFS]: "make it writable",
                STORAGE_ERRNOS[errno.EFBIG]: "raise the limit or free space"}

    if storage_error_line(error) is None:
        return None
    reason, what = None, None
    for link in error_chain(error):
        if isinstance(link, CheckpointWriteError) and what is None and link.step is not None:
            what = f"checkpoint step {link.step}"
        if isinstance(link, OSError) and link.errno in STORAGE_ERRNOS and reason is None:
            reason = STORAGE_ERRNOS[link.errno]
            what = what or (str(link.filename) if link.filename else None)
        for code, text in STORAGE_ERRNOS.items():
            if reason is None and os.strerror(code) in str(link):
                reason = text
    root = _run["root"]
    what = f" while writing {what}" if what else ""
    remedy = REMEDIES.get(reason, "free space")
    if root is None:
        return f"{reason}{what}: {remedy} and rerun"
    details = _write_details(root, error)
    return (f"{reason}{what}: {_disk(root)}; kept in {root}: {_kept(root)}; {remedy}, then "
            f"continue with: {resume_command()}" + (f" (details: {details})" if details else ""))


def ending_line(error: BaseException) -> tuple[int, str] | None:
    """(exit status, the one line) for an ending this module owns, else None."""
    from spopp_jax.checkpoint import CheckpointCorruptError, NonFiniteStateError
    from spopp_jax.learner import NonFiniteUpdatesError

    root = _run["root"]
    where = f" in {root}" if root is not None else ""
    signum = _signal_state["signum"]
    if isinstance(error, _StorageEnding):
        error = error.error
    chain = list(error_chain(error))
    if signum is not None or any(isinstance(e, KeyboardInterrupt) for e in chain):
        signum = signum or signal.SIGINT
        name = signal.Signals(signum).name
        if root is None:
            return 128 + signum, f"interrupted ({name}) before the run folder was opened: nothing in it changed"
        return 128 + signum, (f"interrupted ({name}): kept{where}: {_kept(root)}; continue with: "
                              f"{resume_command()}")
    for link in chain:
        if isinstance(link, (NonFiniteUpdatesError, NonFiniteStateError)):
            steps = complete_steps(root / "checkpoints") if root is not None else []
            resume = (f"the last finite checkpoint, step {steps[-1]}{where}, is the resume point "
                      f"(--resume after fixing the cause)" if steps else "no checkpoint was written")
            return EXIT_FAILED, f"error: {str(link).splitlines()[0]}. Not exported, not done; {resume}"
        if isinstance(link, CheckpointCorruptError):
            return EXIT_USER_ERROR, (f"error: {str(link).splitlines()[0]}; --resume continues from the newest "
                                     "intact step, --resume_step <k> from another")
    line = _storage_line(error)
    if line is not None:
        return EXIT_USER_ERROR, f"error: {line}"
    return None


def _storage_line_needed(error: BaseException) -> bool:
    from rollout_bridge.run_errors import UserError, storage_error_line

    return not isinstance(error, UserError) and storage_error_line(error) is not None


_signal_state: dict[str, Any] = {"signum": None, "stderr_fd": None}


def _on_signal(signum, frame) -> None:
    if _signal_state["signum"] is not None:   # a second signal: out now
        _write_line(f"interrupted again ({signal.Signals(signum).name}): exiting now; --resume continues "
                    "from the last checkpoint")
        _release()
        os._exit(128 + signum)
    _signal_state["signum"] = signum
    if _run["root"] is None:   # nothing written yet (imports, config): no cleanup to wait for
        _write_line(f"interrupted ({signal.Signals(signum).name}) before the run folder was opened: nothing in it changed")
        os._exit(128 + signum)
    _quiet_stderr()
    raise RunInterrupted(signum)


def _quiet_stderr() -> None:
    """fd 2 -> <run>/interrupt.log (third-party teardown noise); our line uses the saved fd."""
    root = _run["root"]
    if _signal_state["stderr_fd"] is not None or root is None:
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        log = open(root / INTERRUPT_LOG, "a")
        os.dup2(log.fileno(), 2)
        sys.stderr = log
        _signal_state["stderr_fd"] = saved
    except OSError:
        pass


def _write_line(line: str) -> None:
    fd = _signal_state["stderr_fd"]
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a closed or broken stdout must not hide the line
        pass
    os.write(fd if fd is not None else 2, (line + "\n").encode())


def _release() -> None:
    lock = _run["lock"]
    if lock is not None:
        lock.release()


def install_signal_handlers() -> None:
    """SIGINT and SIGTERM -> `_on_signal` (call first thing, before the heavy imports)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _on_signal)


def run_guarded(main: Callable[[], Any]) -> int:
    """`run_cleanly(main)` with the endings above: an interrupt, a non-finite run or an
    unreadable checkpoint print one line (see `ending_line`) and end the process with
    ``os._exit``; everything else as `run_cleanly`, and a single-process job that ends
    with a status ends with ``os._exit`` too (no teardown)."""
    install_signal_handlers()

    def main_with_storage_endings():
        try:
            return main()
        except Exception as error:  # noqa: BLE001 - only a refused write is rerouted
            if _storage_line_needed(error):
                raise _StorageEnding(error) from error
            raise

    try:
        status = run_cleanly(main_with_storage_endings)
    except BaseException as error:  # noqa: BLE001 - re-raised unless it is one of ours
        ending = ending_line(error)
        if ending is None:
            raise
        status, line = ending
        noise = _run["root"] / INTERRUPT_LOG if _run["root"] is not None else None
        if noise is not None and noise.is_file():
            sys.stderr.flush()
            if noise.stat().st_size == 0:
                noise.unlink()
            else:
                line += f" (other output: {noise})"
        _write_line(line)
        _release()
        os._exit(status)
    _release()
    import jax

    if jax.process_count() == 1:
        # The job is over and its files are closed: end without the interpreter's teardown,
        # where a signal meets the default handlers again (and XLA / orbax threads may
        # still run). Several processes exit normally (jax.distributed's own shutdown).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
