"""Policy weights over HTTP (rollout_bridge/engine/vllm_upload.py) for servers that share no
filesystem with the trainer: the server-side inbox, and the fleet publishing to a stand-in
server (tests/standin_vllm_server.py: real HTTP on 127.0.0.1, the real worker extension's
marker check) whose weights folder the trainer never names; a stand-in killed and restarted
on its port rejoins at the current policy while a request waits for it.
The same route on real vLLM: tests/integration/test_remote_server_cpu.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import httpx
import pytest

from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.vllm_fleet import VllmFleetConfig, VllmFleetEngine, VllmServerSpec
from rollout_bridge.engine.vllm_launcher import free_port, healthy
from rollout_bridge.engine.vllm_upload import PolicyInbox, UploadError, check_file_name, folder_files
from rollout_bridge.engine.vllm_weights import publish_folder
from rollout_bridge.engine.vllm_worker_ext import POLICY_MARKER

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin_vllm_server.py")


def write_weights(payload: bytes):
    def write(tmp):
        with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
            f.write(payload)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({"payload_bytes": len(payload)}, f)
    return write


def digests(folder) -> dict[str, str]:
    return {name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
            for name in folder_files(folder)}


# ------------------------------------------------------------------ the inbox (server side)


def test_inbox_publishes_a_complete_marked_folder_and_refuses_a_partial_one(tmp_path):
    inbox = PolicyInbox(str(tmp_path / "inbox"), keep=2)
    assert inbox.write_file(3, "model.safetensors", [b"ab", b"cd"]) == 4
    with pytest.raises(UploadError, match="config.json was not uploaded"):
        inbox.commit(3, {"model.safetensors": 4, "config.json": 2})
    with pytest.raises(UploadError, match="has 4 bytes, expected 5"):
        inbox.commit(3, {"model.safetensors": 5})
    assert not os.path.exists(inbox.folder(3))  # nothing half-published
    folder = inbox.commit(3, {"model.safetensors": 4})
    assert folder == inbox.folder(3) and open(os.path.join(folder, "model.safetensors"), "rb").read() == b"abcd"
    assert json.load(open(os.path.join(folder, POLICY_MARKER))) == {"policy_event": 3}
    inbox.write_file(4, "model.safetensors", [b"x"])  # an upload that never commits
    for event in (5, 6):
        inbox.write_file(event, "model.safetensors", [b"x"])
        inbox.commit(event, {"model.safetensors": 1})
    assert sorted(os.listdir(inbox.root)) == ["policy-00000005", "policy-00000006"]  # the newest `keep`


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "", "a..b"])
def test_inbox_refuses_names_outside_its_folder(name):
    with pytest.raises(UploadError, match="refused file name"):
        check_file_name(name)


def test_inbox_refuses_a_bad_event(tmp_path):
    inbox = PolicyInbox(str(tmp_path))
    for event in (-1, "x"):
        with pytest.raises(UploadError, match="policy event"):
            inbox.write_file(event, "model.safetensors", [b""])


# ------------------------------------------------------------------ fleet -> stand-in over HTTP


def start_standin(port: int, model_dir, weights_dir) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, STANDIN, "--port", str(port), "--model", str(model_dir),
                                "--weights-dir", str(weights_dir)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not healthy(f"http://127.0.0.1:{port}", timeout_s=1.0):
        assert process.poll() is None and time.monotonic() < deadline, "stand-in server did not start"
        time.sleep(0.05)
    return process


def standin_loads(url: str) -> list[tuple[str, int]]:
    with urllib.request.urlopen(f"{url}/standin/loads", timeout=10) as response:
        return [tuple(x) for x in json.load(response)["loads"]]


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def test_fleet_uploads_each_policy_to_a_server_without_the_trainers_folder(tmp_path):
    trainer, server_dir = tmp_path / "trainer", tmp_path / "server"
    first = publish_folder(trainer, 0, write_weights(b"\x01" * 10_000))
    second = publish_folder(trainer, 1, write_weights(os.urandom(3 * (8 << 20) // 2)))  # > one upload chunk
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    process = start_standin(port, tmp_path / "model", server_dir)

    async def run():
        engine = VllmFleetEngine(VllmFleetConfig(servers=(VllmServerSpec(url, 2),), initial_folder=first,
                                                 health_interval_s=0.1))
        await engine.start()
        joined = standin_loads(url)
        await engine.publish(second, 1)
        result = await engine.generate([1, 2], SamplingParams(max_new_tokens=3))
        states, stats = engine.server_states(), engine.stats
        await engine.close()
        return joined, result, states, stats

    try:
        joined, result, states, stats = asyncio.run(run())
        loads = standin_loads(url)
    finally:
        stop(process)
    # the server loaded its OWN copies (under its weights dir), each checked against its marker
    assert [event for _, event in loads] == [0, 1] and joined == loads[:1]
    for (folder, event), source in zip(loads, (first, second)):
        assert folder.startswith(str(server_dir)) and not folder.startswith(str(trainer))
        assert digests(folder) == digests(source)  # byte-identical files
    assert stats.uploads == 2 and states[0][1:3] == ("ready", 1) and result.policy_event == 1


def test_a_transport_the_server_lacks_is_refused_at_join(tmp_path):
    folder = publish_folder(tmp_path / "trainer", 0, write_weights(b"w"))
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, STANDIN, "--port", str(port), "--model", str(tmp_path)],
                               start_new_session=True)  # no --weights-dir: no upload route
    try:
        deadline = time.monotonic() + 30
        while not healthy(url, timeout_s=1.0):
            assert time.monotonic() < deadline
            time.sleep(0.05)

        async def run():
            engine = VllmFleetEngine(VllmFleetConfig(servers=(VllmServerSpec(url),), initial_folder=folder,
                                                     weights_transport="http"))
            await engine.start()
            states = engine.server_states()
            await engine.close()
            return states

        assert asyncio.run(run())[0][1] == "dead"
    finally:
        stop(process)
    with pytest.raises(ValueError, match="weights_transport"):
        VllmFleetConfig(servers=(VllmServerSpec(url),), weights_transport="nfs")


def test_a_restarted_remote_server_rejoins_at_the_current_policy_while_requests_wait(tmp_path):
    trainer, server_dir = tmp_path / "trainer", tmp_path / "server"
    folders = [publish_folder(trainer, k, write_weights(bytes([k]) * 1000)) for k in range(3)]
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    process = start_standin(port, tmp_path / "model", server_dir)
    restarted = {}

    async def run():
        nonlocal process
        engine = VllmFleetEngine(VllmFleetConfig(servers=(VllmServerSpec(url, 2),), initial_folder=folders[0],
                                                 health_interval_s=0.1, backoff_s=0.01, outage_wait_s=30.0))
        await engine.start()
        await engine.publish(folders[1], 1)
        stop(process)  # the node goes down ...
        for _ in range(200):
            if engine.server_states()[0][1] == "dead":
                break
            await asyncio.sleep(0.05)
        restarted["dead_seen"] = engine.server_states()[0][1] == "dead"
        await engine.publish(folders[2], 2)  # ... misses a publish ...
        waiting = asyncio.ensure_future(engine.generate([1], SamplingParams(max_new_tokens=2)))
        await asyncio.sleep(0.3)
        restarted["waited"] = not waiting.done()  # no server: the request waits (outage_wait_s)
        process = start_standin(port, tmp_path / "model", server_dir)  # ... and comes back empty
        result = await waiting
        states, stats = engine.server_states(), engine.stats
        await engine.close()
        return result, states, stats

    try:
        result, states, stats = asyncio.run(run())
        loads = standin_loads(url)
    finally:
        stop(process)
    assert restarted == {"dead_seen": True, "waited": True}
    assert loads and loads[-1][1] == 2 and digests(loads[-1][0]) == digests(folders[2])
    assert states[0][1:3] == ("ready", 2) and result.policy_event == 2
    assert stats.servers_lost == 1 and stats.servers_rejoined == 1 and stats.failed == 0


def test_a_server_restarted_between_health_checks_is_caught_by_its_policy_event(tmp_path):
    trainer = tmp_path / "trainer"
    folders = [publish_folder(trainer, k, write_weights(bytes([k]) * 100)) for k in range(2)]
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    process = start_standin(port, tmp_path / "model", tmp_path / "server")

    async def run():
        nonlocal process
        engine = VllmFleetEngine(VllmFleetConfig(servers=(VllmServerSpec(url, 2),), initial_folder=folders[0],
                                                 health_interval_s=0.5))
        await engine.start()
        await engine.publish(folders[1], 1)
        stop(process)
        process = start_standin(port, tmp_path / "model", tmp_path / "server2")  # back within one interval
        for _ in range(100):
            await asyncio.sleep(0.05)
            if engine.stats.servers_rejoined:
                break
        states, stats = engine.server_states(), engine.stats
        await engine.close()
        return states, stats

    try:
        states, stats = asyncio.run(run())
        loads = standin_loads(url)
    finally:
        stop(process)
    assert stats.servers_lost == 1 and stats.servers_rejoined == 1
    assert states[0][1:3] == ("ready", 1) and [event for _, event in loads] == [1]


def test_serve_entry_point_adds_the_fleet_flags_and_refuses_conflicting_ones(capsys):
    from rollout_bridge.engine.vllm_fleet import FLEET_SERVER_FLAGS
    from rollout_bridge.serve import split_args

    own, args = split_args(["--model", "/m", "--port", "9", "--weights-dir", "/w", "--served-model-name", "mine"])
    assert own.weights_dir == "/w" and own.keep_policies == 2 and "--weights-dir" not in args
    pairs = list(zip(args, args[1:]))
    for flag, value in FLEET_SERVER_FLAGS:
        assert (flag, "mine" if flag == "--served-model-name" else value) in pairs
    assert args.count("--served-model-name") == 1  # the user's name is kept
    with pytest.raises(SystemExit):
        split_args(["--model", "/m", "--logprobs-mode=processed_logprobs"])
    assert "the fleet needs --logprobs-mode raw_logprobs" in capsys.readouterr().err


def test_a_server_whose_routes_cannot_be_read_yet_joins_later_with_uploads(tmp_path):
    """An /openapi.json that times out (a busy server building vLLM's schema) must not be
    read as "no upload route": the server would be named a trainer path it cannot read."""
    from rollout_bridge.engine.vllm_upload import COMMIT_ROUTE, PolicyInbox

    folder = publish_folder(tmp_path / "trainer", 0, write_weights(b"w" * 64))
    inbox = PolicyInbox(str(tmp_path / "server"))
    state = {"openapi_calls": 0, "event": -1, "loaded": []}

    async def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/openapi.json":
            state["openapi_calls"] += 1
            if state["openapi_calls"] == 1:
                raise httpx.ReadTimeout("schema still building", request=request)
            return httpx.Response(200, json={"paths": {COMMIT_ROUTE: {"post": {}}}})
        if request.method == "PUT":
            _, _, _, event, _, name = path.split("/")
            with inbox.open_file(event, name) as f:
                f.write(request.content)
            return httpx.Response(200, json={})
        if path.endswith("/commit"):
            return httpx.Response(200, json={"folder": inbox.commit(path.split("/")[3], json.loads(request.content)["files"])})
        if path == "/collective_rpc":
            body = json.loads(request.content)
            if body["method"] == "spopp_load_policy":
                state["loaded"].append(body["args"][0])
                state["event"] = int(body["args"][1])
            return httpx.Response(200, json={"results": [str(state["event"])]})
        return httpx.Response(200, json={"success": True})

    async def run():
        client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
        engine = VllmFleetEngine(VllmFleetConfig(servers=(VllmServerSpec("http://10.0.0.9:8000"),),
                                                 initial_folder=folder, health_interval_s=0.05), client=client)
        await engine.start()
        first = engine.server_states()[0][1]
        for _ in range(100):
            if engine.server_states()[0][1] == "ready":
                break
            await asyncio.sleep(0.02)
        states = engine.server_states()
        await engine.close()
        return first, states

    first, states = asyncio.run(run())
    assert first == "dead" and states[0][1:3] == ("ready", 0)
    assert state["loaded"] == [inbox.folder(0)]  # its own copy, never the trainer's path
