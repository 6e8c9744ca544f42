"""regen's transformers capture server against SpecForge 0.2.0's own client, over a real Mooncake master.

Real parts, all on loopback: `mooncake_master` and Mooncake's HTTP metadata server (the venv the
mooncake_master role builds from envs/mooncake.lock); `python -m regen.training.capture_server` on the
demo model (CPU); and, in the SpecForge venv, SpecForge's `SGLangServerCaptureAdapter.produce_refs` (the
online producer's client: it posts the batch, checks every returned spec against the DFlash capture
contract with `verify_capture_specs`) and `MooncakeFeatureStore.get` (the consumer's zero-copy fetch
with `get_into`). The fetched tensors must be exactly what regen's offline capture computes for the same
prompts in the same forward (`regen.training.capture.HFBackend`), under the names, shapes and dtypes
SpecForge's DFlash reader expects.

Refusals: a capture server whose Mooncake master does not answer exits 3 and says so; one whose port is
taken exits 2 and names the port; a request for more than the server's --max-length is refused with 400.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.mooncake import MooncakeMaster, client_dir, free_ports, mooncake_venv
from tests.helpers.specforge_venv import specforge_python

ROOT = Path(__file__).resolve().parents[2]
DEMO_CACHE = ROOT / ".cache" / "demo-models"
LAYERS = [1, 2]

# Runs in the SpecForge venv: SpecForge's producer-side client and consumer-side store, nothing of regen.
DRIVER = r"""
import json, sys, torch
from specforge.inference.adapters.server_capture import SGLangServerCaptureAdapter, ServerCaptureSchema
from specforge.inference.capture import CaptureConfig
from specforge.runtime.contracts import PromptTask
from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore

args = json.loads(sys.argv[1])
store = MooncakeFeatureStore(store_id="regen-test", retain_on_release=True,
                             setup_kwargs=dict(args["mooncake"], global_segment_size=0))
# SpecForge's DFlash server-streaming layout (algorithms/dflash/providers.py).
schema = ServerCaptureSchema(aux_feature="hidden_states", last_hidden_feature=None,
                             passthrough=(("input_ids", "input_ids", ()), ("loss_mask", "loss_mask", ())))
adapter = SGLangServerCaptureAdapter(args["url"], store, run_id="regen-test", algorithm="dflash",
                                     schema=schema)
capture = CaptureConfig.from_strategy({"hidden_states", "input_ids", "loss_mask"}, args["layers"],
                                      target_repr=None, target_hidden_size=args["hidden"])
tasks = [PromptTask(task_id=f"t{i}", run_id="regen-test", source_id=f"s{i}",
                    payload={"input_ids": ids, "loss_mask": [0] + [1] * (len(ids) - 1)}, max_length=64)
         for i, ids in enumerate(args["prompts"])]
refs = adapter.produce_refs(tasks, capture=capture)
out = {}
for task, ref in zip(tasks, refs):
    if not hasattr(ref, "feature_specs"):
        out[task.task_id] = {"failure": ref.reason}
        continue
    tensors, handle = store.get(ref)
    out[task.task_id] = {"specs": {n: [list(s.shape), s.dtype] for n, s in ref.feature_specs.items()},
                         "uri": ref.feature_store_uri}
    torch.save(tensors, f"{args['out']}/{task.task_id}.pt")
    store.release(handle)
    store.abort(ref.sample_id, reason="test-done")
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("capture-model") / "demo"
    subprocess.run(
        [sys.executable, "-m", "regen.demo.build", "--output", str(model), "--cache-dir", str(DEMO_CACHE)],
        check=True,
        capture_output=True,
    )
    return model


def _server(
    model: Path, port: int, env: dict[str, str], client: Path, log: Path, *extra: str
) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "regen.training.capture_server",
        "--model",
        str(model),
        "--layers",
        ",".join(map(str, LAYERS)),
        "--port",
        str(port),
        "--max-length",
        "64",
        *extra,
    ]
    env = {**os.environ, **env, "PYTHONPATH": f"{client}:{ROOT / 'src'}"}
    with open(log, "w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"the capture server never answered:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.terminate()
    return proc.wait(timeout=30)


def test_specforges_client_gets_regens_features_through_mooncake(tmp_path: Path, demo_model: Path) -> None:
    venv = mooncake_venv(tmp_path)
    client = client_dir(venv, tmp_path / "client")
    prompts = [
        [3840, 17, 250, 1044, 9, 77, 3841],
        [3840, 5, 6, 7, 8],
        [3840, 300, 301, 302, 303, 304, 305, 306, 3841],
    ]
    with MooncakeMaster(venv, tmp_path / "mooncake") as master:
        (port,) = free_ports(1)
        url = f"http://127.0.0.1:{port}"
        log = tmp_path / "capture.log"
        proc = _server(
            demo_model, port, {**master.env(), "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(64 << 20)}, client, log
        )
        try:
            _wait_healthy(url, proc, log)
            # Longer than --max-length: refused as a whole, as SGLang refuses a prompt past its context.
            request = urllib.request.Request(
                url + "/generate",
                data=json.dumps(
                    {
                        "input_ids": [list(range(70))],
                        "sampling_params": {"max_new_tokens": 0},
                        "spec_capture": [{"store_id": "x", "sample_id": "y"}],
                    }
                ).encode(),
                headers={"Content-Type": "application/json"},
            )
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == 400 and "--max-length 64" in refused.value.read().decode()

            out = tmp_path / "fetched"
            out.mkdir()
            args = {
                "url": url,
                "layers": LAYERS,
                "hidden": 64,
                "prompts": prompts,
                "out": str(out),
                "mooncake": {
                    "master_server_addr": master.master_addr,
                    "metadata_server": master.metadata_url,
                    "local_hostname": "127.0.0.1",
                    "protocol": "tcp",
                },
            }
            driver = subprocess.run(
                [str(specforge_python()), "-c", DRIVER, json.dumps(args)],
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "PYTHONPATH": str(client)},
                check=False,
            )
            assert driver.returncode == 0, driver.stderr[-4000:] + log.read_text()[-2000:]
            result = json.loads(driver.stdout.strip().splitlines()[-1])
        finally:
            assert _stop(proc) == 0, log.read_text()[-3000:]
    assert "stopping after 3 captures" in log.read_text()

    import torch

    from regen.training.capture import HFBackend

    expected = HFBackend(str(demo_model), LAYERS, "bfloat16", "cpu", True).capture(prompts)
    for index, ids in enumerate(prompts):
        entry = result[f"t{index}"]
        assert "failure" not in entry, entry
        # The DFlash layout SpecForge's online reader takes: [1, len, layers x hidden] bf16 + int64 ids/mask.
        assert entry["specs"] == {
            "hidden_states": [[1, len(ids), len(LAYERS) * 64], "bfloat16"],
            "input_ids": [[1, len(ids)], "int64"],
            "loss_mask": [[1, len(ids)], "int64"],
        }
        assert entry["uri"] == f"mooncake://regen-test/regen-test:t{index}"
        tensors = torch.load(out / f"t{index}.pt")
        assert torch.equal(tensors["hidden_states"][0], expected[index])
        assert tensors["input_ids"][0].tolist() == ids
        assert tensors["loss_mask"][0].tolist() == [0] + [1] * (len(ids) - 1)


def test_refusals_name_the_cause(tmp_path: Path, demo_model: Path) -> None:
    venv = mooncake_venv(tmp_path)
    client = client_dir(venv, tmp_path / "client")
    rpc, http, port = free_ports(3)
    # No master behind these endpoints: the server says so and exits 3 before loading the model.
    unreachable = {
        "MOONCAKE_MASTER_SERVER_ADDR": f"127.0.0.1:{rpc}",
        "MOONCAKE_METADATA_SERVER": f"http://127.0.0.1:{http}/metadata",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(16 << 20),
    }
    log = tmp_path / "no-master.log"
    proc = _server(demo_model, port, unreachable, client, log, "--mooncake-wait", "1")
    assert proc.wait(timeout=60) == 3, log.read_text()[-3000:]
    assert f"the Mooncake master at 127.0.0.1:{rpc} does not accept connections" in log.read_text()

    # A port that is taken: exit 2 naming it, before anything else.
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        log = tmp_path / "port.log"
        proc = _server(demo_model, port, unreachable, client, log)
        assert proc.wait(timeout=60) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in log.read_text()
