"""The optional wandb sink (offline mode, a real wandb run on disk) gets the same metric
names and values as metrics.jsonl and TensorBoard."""

from __future__ import annotations

import re
import struct
import sys
import time
from pathlib import Path

import pytest

from rollout_bridge.metrics import METRICS_FILE, MetricsWriter, WandbSink, read_metrics

ROWS = [
    {"success_rate": 0.25, "learner/loss": 1.5, "diag/policy_lag_max": 3, "skipped": "text"},
    {"success_rate": 0.5, "learner/loss": 0.75, "diag/policy_lag_max": 1},
    {"success_rate": 0.625, "learner/loss": float("nan"), "diag/policy_lag_max": 0},
]
TFRECORD_HEADER = struct.Struct("<QI")   # length, masked crc of the length
TFRECORD_FOOTER_BYTES = 4                # masked crc of the data
WANDB_FLUSH_WAIT_S = 30.0


def _tensorboard_scalars(tb_dir: Path) -> dict[tuple[int, str], float]:
    """{(step, tag): value} from tensorboardX event files (TFRecord framing)."""
    from tensorboardX.proto.event_pb2 import Event

    scalars = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            length, _ = TFRECORD_HEADER.unpack_from(data, offset)
            offset += TFRECORD_HEADER.size
            event = Event.FromString(data[offset:offset + length])
            offset += length + TFRECORD_FOOTER_BYTES
            for value in event.summary.value:
                scalars[(event.step, value.tag)] = value.simple_value
    return scalars


def _wandb_history(run_dir: Path, keys: list[str]) -> dict[str, list[str]]:
    """{key: logged values as JSON text} read from the offline run's record file (waiting
    until all but the last key appear). wandb (>= 0.19) has no Python reader for it, so each history item
    (protobuf: field 2 = key, field 16 = value_json) is matched in the bytes."""
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    # wandb's core process may still be writing after run.finish() returns
    deadline = time.monotonic() + WANDB_FLUSH_WAIT_S
    while True:
        data = files[0].read_bytes()
        if all(key.encode() in data for key in keys[:-1]) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    history = {}
    for key in keys:
        encoded = key.encode()
        item = re.compile(re.escape(b"\x12" + bytes([len(encoded)]) + encoded + b"\x82\x01")
                          + rb"(.)", re.S)   # then a one-byte length (values are short)
        history[key] = [data[m.end():m.end() + m.group(1)[0]].decode()
                        for m in item.finditer(data)]
    return history


def test_wandb_offline_gets_the_jsonl_and_tensorboard_rows(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    sink = WandbSink(tmp_path, project="spopp-test", mode="offline", config={"seed": 0})
    assert str(tmp_path) in sink.location
    with MetricsWriter(tmp_path, tensorboard=True, sinks=[sink]) as writer:
        for step, row in enumerate(ROWS, start=1):
            writer.write(step, row)

    rows = read_metrics(tmp_path / METRICS_FILE)
    names = sorted({k for r in rows for k in r if k != "step"})
    assert names == ["diag/policy_lag_max", "learner/loss", "success_rate"]
    tensorboard = _tensorboard_scalars(tmp_path / "tb")
    assert {tag for _, tag in tensorboard} == set(names)
    history = _wandb_history(tmp_path, names + ["skipped"])
    assert history["skipped"] == []                      # non-scalars dropped everywhere
    for name in names:
        logged = [r[name] for r in rows if name in r]
        # each row appears in more than one record kind (the request and the history)
        assert sorted({float(v) for v in history[name]}) == pytest.approx(sorted(set(logged))), name
        assert len(history[name]) >= len(logged), name
        assert [tensorboard[(r["step"], name)] for r in rows if name in r] == \
            pytest.approx(logged)


def test_wandb_sink_refuses_unknown_mode(tmp_path):
    with pytest.raises(ValueError, match="wandb mode"):
        WandbSink(tmp_path, project="p", mode="disabled-typo")


def test_wandb_missing_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"spopp-jax\[wandb\]"):
        WandbSink(tmp_path, project="p")
