"""Clean failures (one line, exit status 2) and the quiet default path: a missing config
file, an unwritable output folder, a full disk (a real ENOSPC from /dev/full), a config
from another version; transformers' torch-absent notice is dropped at its logger and
nothing else is."""

from __future__ import annotations

import errno
import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from spopp_jax import quiet
from rollout_bridge.config import TrainConfig, format_config_error, load_config
from rollout_bridge.run_errors import (EXIT_USER_ERROR, UserError, check_config_path,
                                  check_output_dir, run_cleanly, storage_error_line,
                                  unknown_fields_line)

ROOT = Path(__file__).resolve().parents[1]
DEV_FULL = Path("/dev/full")     # Linux: every write fails with ENOSPC
TORCH_NOTICE = "PyTorch was not found"


def _run(main) -> tuple[int, str]:
    stderr = io.StringIO()
    status = run_cleanly(main, stderr=stderr)
    return status, stderr.getvalue()


def _assert_one_line(status: int, text: str, *fragments: str) -> None:
    assert status == EXIT_USER_ERROR
    lines = text.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    for fragment in fragments:
        assert fragment in lines[0], text


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope" / "recipe.yaml"
    for argv in (["--config_path", str(missing)], [f"--config_path={missing}"]):
        status, text = _run(lambda: check_config_path(argv))
        _assert_one_line(status, text, str(missing), "no such file", "folder")
    check_config_path(["--seed", "1"])                       # no config: nothing to check
    existing = tmp_path / "recipe.yaml"
    existing.write_text("seed: 1\n")
    check_config_path(["--config_path", str(existing)])


@pytest.mark.parametrize("make_path, fragment", [
    (lambda tmp: tmp / "a_file" / "run", "Not a directory"),
    (lambda tmp: Path("/proc/spopp_run"), "output_dir='/proc/spopp_run'"),
], ids=["parent-is-a-file", "proc"])
def test_unwritable_output_dir(tmp_path, make_path, fragment):
    (tmp_path / "a_file").write_text("x")
    path = make_path(tmp_path)
    status, text = _run(lambda: check_output_dir(path))
    _assert_one_line(status, text, "cannot be written", fragment)


def test_writable_output_dir_is_created_and_left_clean(tmp_path):
    folder = check_output_dir(tmp_path / "new" / "run")
    assert folder.is_dir() and list(folder.iterdir()) == []


@pytest.mark.skipif(not DEV_FULL.exists(), reason="/dev/full is Linux-only")
def test_disk_full_during_a_write_is_one_line():
    def write_metrics():
        with open(DEV_FULL, "w") as f:
            f.write("{}\n" * 100_000)

    status, text = _run(write_metrics)
    _assert_one_line(status, text, "the disk is full", "--resume")


def test_disk_full_reported_as_text_by_a_library():
    """tensorstore (orbax) raises ValueError carrying only the strerror text."""
    def save():
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/3/x")
        except OSError as error:
            raise ValueError(f"Error writing: {error.strerror}") from None

    status, text = _run(save)
    _assert_one_line(status, text, "the disk is full")
    assert storage_error_line(RuntimeError("a bug")) is None


def test_other_errors_keep_their_traceback():
    def bug():
        raise KeyError("not a user mistake")

    with pytest.raises(KeyError):
        run_cleanly(bug, stderr=io.StringIO())
    assert _run(lambda: None) == (0, "")
    status, text = _run(lambda: (_ for _ in ()).throw(UserError("bad thing")))
    _assert_one_line(status, text, "bad thing")


def _draccus_message(tmp_path, yaml_text: str) -> str:
    config = tmp_path / "old.yaml"
    config.write_text(yaml_text)
    from draccus.utils import ParsingError

    with pytest.raises(ParsingError) as info:
        load_config(["--config_path", str(config)])
    return format_config_error(info.value)


def test_config_from_another_version_names_file_fields_and_closest(tmp_path):
    message = _draccus_message(tmp_path, "loss:\n  clip_lo: 0.2\n  is_capp: 2\nsteps: 3\n")
    line = unknown_fields_line(message, str(tmp_path / "old.yaml"), TrainConfig)
    assert line is not None
    for fragment in (str(tmp_path / "old.yaml"), "loss.clip_lo", "loss.is_capp",
                     "loss.clip_low", "loss.is_cap", "another version"):
        assert fragment in line, line
    top = _draccus_message(tmp_path, "stepz: 3\n")
    assert "steps" in unknown_fields_line(top, "c.yaml", TrainConfig)
    assert unknown_fields_line("rollout.top_p must be in (0, 1]", None) is None


@pytest.mark.parametrize("yaml_text, old, new", [
    ("model:\n  dtype: bfloat16\n", "model.dtype", "model.compute_dtype"),
    ("advantage:\n  measure: trajectory\n", "advantage.measure", "method.measure"),
    ("loss:\n  dual_clip: 10.0\n", "loss.dual_clip", "method.dual_clip"),
    ("tracker:\n  spo_rho_min: 0.9\n", "tracker.spo_rho_min", "method.rho_min"),
    ("rollout:\n  max_inflight: 8\n", "rollout.max_inflight", "rollout.max_in_flight"),
    ("rollout:\n  max_seq_len: 512\n", "rollout.max_seq_len", "rollout.max_total_tokens"),
    ("advantage:\n  eps: 1.0e-6\n", "advantage.eps", "advantage.whiten_eps"),
    ("rollout:\n  engine:\n    type: jax\n    program_store: false\n", "rollout.engine.program_store",
     "program_store"),
])
def test_a_renamed_setting_names_its_new_name(tmp_path, yaml_text, old, new):
    """A config written before a rename is told the new name, not the closest spelling
    (difflib pointed model.dtype at model.param_dtype, the master weights' dtype)."""
    line = unknown_fields_line(_draccus_message(tmp_path, yaml_text), "old.yaml", TrainConfig)
    assert f"{old} was renamed to {new}" in line, line


@pytest.mark.parametrize("flag, new", [("--rollout.max_inflight", "--rollout.max_in_flight"),
                                       ("--rollout.max_seq_len=512", "--rollout.max_total_tokens"),
                                       ("--advantage.eps", "--advantage.whiten_eps"),
                                       ("--rollout.engine.program_store", "--program_store")])
def test_a_renamed_flag_names_its_new_name(flag, new):
    import train

    with pytest.raises(UserError, match=f"was renamed to {new}"):
        train.parse_config([flag, "8"] if "=" not in flag else [flag])


def test_quiet_drops_only_the_torch_notice():
    quiet.install()
    quiet.install()                                          # idempotent
    logger = logging.getLogger("transformers")
    assert sum(isinstance(f, quiet.DroppedNotice) for f in logger.filters) == 1
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        logger.warning("PyTorch was not found. Models won't be available ...")
        logger.warning("an actionable warning")
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue() == "an actionable warning\n"


IMPORT_WITHOUT_TORCH = "import sys; sys.modules['torch'] = None; {imports}"


@pytest.mark.parametrize("imports, notice_expected", [
    ("import transformers", True),                            # the control: it can fail
    ("import rollout_bridge.tokenizer; import transformers; "
     "from transformers import AutoTokenizer", False),
    ("import rollout_bridge.tiny_model; from rollout_bridge.agent import ChatFormat", False),
], ids=["bare-transformers", "tokenizer", "train-py-imports"])
def test_default_path_has_no_torch_notice(imports, notice_expected):
    result = subprocess.run([sys.executable, "-c", IMPORT_WITHOUT_TORCH.format(imports=imports)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (TORCH_NOTICE in result.stderr) == notice_expected, result.stderr
    if not notice_expected:
        assert result.stderr == ""


def test_user_error_kind_prefixes_the_line():
    status, text = _run(lambda: (_ for _ in ()).throw(UserError("x must be > 0", "config error")))
    assert (status, text) == (EXIT_USER_ERROR, "config error: x must be > 0\n")
