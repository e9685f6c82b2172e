"""The reward server (``flowseam reward-serve``, :mod:`flowseam.rewards.reward_server`) and its client
(:class:`flowseam.rewards.remote.RemoteReward`), over real uvicorn on a free loopback port: the
scores equal the in-process scores exactly (brightness, channel_contrast, audio_rms, ocr), batches
split, the API key, JSON-only bodies (a pickle is refused), retries with backoff (a server that
comes up late, 503s), a server that stays down, a reward fault on the server, the command, and
a Flow-GRPO run whose reward server dies: it stops naming its last checkpoint, and rerun once the
server is back it resumes there and ends where an uninterrupted run ends."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import run_main

import flowseam
from flowseam.errors import InvalidInputError, RewardFaultError, RewardServerError
from flowseam.rewards import remote as remote_module
from flowseam.rewards.remote import RemoteReward
from flowseam.rewards.reward_server import build_app, exposure_warning
from flowseam.rewards.wire import encode_request
from flowseam.serve.server import bind
from flowseam.training import get_reward
from flowseam.training.checkpoint import latest_checkpoint
from flowseam.training.flowgrpo import FlowGRPO
from flowseam.training.metrics import read_metrics

SAMPLING = dict(num_steps=2, height=32, width=32, max_sequence_length=16)


class Served:
    """``build_app(reward, name, **options)`` served by uvicorn in a thread on 127.0.0.1:``port``
    (0: a free one), until :meth:`stop`."""

    def __init__(self, reward, name: str, port: int = 0, front=None, **options) -> None:
        import uvicorn

        self.app = build_app(reward, name, **options)
        self.sock = bind("127.0.0.1", port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/{name}"
        app = self.app if front is None else front(self.app)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    @property
    def counts(self) -> dict[str, int]:
        return dict(self.app.state.counts)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def __enter__(self) -> "Served":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _frames(b: int, f: int = 2, h: int = 8, w: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((b, f, h, w, 3), dtype=np.float32)


@pytest.fixture
def sleeps(monkeypatch):
    """The client's backoff waits, recorded (and still slept)."""
    import types

    waits: list[float] = []

    def sleep(seconds):
        waits.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(remote_module, "time", types.SimpleNamespace(sleep=sleep))
    return waits


# -- same inputs, same numbers ---------------------------------------------------------------------
def test_the_server_scores_what_the_in_process_reward_scores():
    prompts = [f"p{i}" for i in range(5)]
    x = _frames(5)
    for name, args in (("brightness", {}), ("channel_contrast", {"channel": 1})):
        reward = get_reward(name, **args)
        with Served(reward, name) as served:
            remote = RemoteReward(served.url)
            got = remote(prompts, x)
            assert got.dtype == torch.float32 and got.shape == (5,)
            assert torch.equal(got, torch.as_tensor(reward(prompts, x), dtype=torch.float32)), name
            # PNG carries 8-bit frames: exact for frames on the 1/255 grid
            q = np.round(np.clip(x, 0, 1) * 255).astype(np.uint8).astype(np.float32) / \
                np.float32(255)
            png = RemoteReward(served.url, format="png")(prompts, x)
            assert torch.equal(png, torch.as_tensor(reward(prompts, q), dtype=torch.float32))
            assert torch.equal(RemoteReward(served.url, format="png")(prompts, q), png)
            # MP4 is lossy H.264: close, not equal
            big = np.repeat(np.repeat(q, 2, 2), 2, 3)  # 16 x 16: smooth enough for H.264
            mp4 = RemoteReward(served.url, format="mp4")(prompts, big)
            assert torch.allclose(mp4, png, atol=0.05), (mp4, png)

    # NaN ("cannot score this sample") travels as JSON null and comes back NaN
    def half(prompts, outputs):
        return torch.tensor([float("nan") if i % 2 else 0.25 for i in range(len(prompts))])

    with Served(half, "half") as served:
        got = RemoteReward(served.url)(prompts, x)
        assert got[0] == 0.25 and torch.isnan(got[1::2]).all()

    # an audio reward scores waveforms (B, C, S): the modality comes from the server
    audio_rms = get_reward("audio_rms")
    wave = np.random.default_rng(1).uniform(-1, 1, (3, 2, 500)).astype(np.float32)
    with Served(audio_rms, "audio_rms") as served:
        remote = RemoteReward(served.url)
        assert remote.modality == "audio"
        assert torch.equal(remote(["a"] * 3, wave), audio_rms(["a"] * 3, wave))
        with pytest.raises(InvalidInputError, match="scores audio"):
            RemoteReward(served.url, format="png")(["a"] * 3, wave)


def test_the_ocr_reward_scores_alike_over_the_server():
    pytest.importorskip("rapidocr_onnxruntime")
    import matplotlib
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" /
                                  "DejaVuSans-Bold.ttf"), 22)
    frames = []
    for text in ("42", "CAT"):
        im = Image.new("RGB", (96, 32), "white")
        ImageDraw.Draw(im).text((48, 16), text, fill="black", font=font, anchor="mm")
        frames.append(np.asarray(im, dtype=np.float32) / 255)
    noise = np.random.default_rng(2).random((32, 96, 3), dtype=np.float32)
    x = np.stack([frames[0], frames[1], noise])[:, None]  # (3, 1, 32, 96, 3)
    prompts = ['a sign that says "42"', 'a sign that says "CAT"', 'a sign that says "42"']
    ocr = get_reward("ocr", threads=1)
    here = ocr(prompts, x)
    assert here[0] == 1 and here[1] == 1  # it reads the rendered text: the check means something
    with Served(ocr, "ocr") as served:
        assert torch.equal(RemoteReward(served.url)(prompts, x), here)


# -- batching, the key, JSON only ------------------------------------------------------------------
def test_a_big_request_is_split_into_batches_and_max_batch_is_enforced(sleeps):
    reward = get_reward("brightness")
    x, prompts = _frames(10), ["p"] * 10
    with Served(reward, "brightness", max_batch=4) as served:
        want = reward(prompts, x)
        before = served.counts
        assert torch.equal(RemoteReward(served.url)(prompts, x), want)  # the server's max_batch
        assert served.counts["requests"] - before["requests"] == 3  # 4 + 4 + 2
        assert served.counts["samples"] - before["samples"] == 10
        assert torch.equal(RemoteReward(served.url, batch_size=3)(prompts, x), want)
        assert served.counts["requests"] - before["requests"] == 3 + 4  # 3 + 3 + 3 + 1
        with pytest.raises(RewardServerError, match=r"HTTP 413.*at most 4 \(--max-batch\)"):
            RemoteReward(served.url, batch_size=8)(prompts, x)
        assert sleeps == []  # a client error is not retried
        # a copy for a reward worker process (Ray pickles the reward it hands to its actors)
        client = RemoteReward(served.url)
        client(prompts[:1], x[:1])  # holds a connection pool now
        assert torch.equal(pickle.loads(pickle.dumps(client))(prompts, x), want)


def test_the_api_key_is_required_when_set_and_accepted(monkeypatch):
    monkeypatch.delenv("FLOWSEAM_REWARD_API_KEY", raising=False)
    reward = get_reward("brightness")
    x = _frames(2)
    with Served(reward, "brightness", api_key="s3cret") as served:
        with pytest.raises(RewardServerError, match=r"HTTP 401.*Bearer"):
            RemoteReward(served.url)(["a", "b"], x)
        with pytest.raises(RewardServerError, match="HTTP 401"):
            RemoteReward(served.url, api_key="wrong")(["a", "b"], x)
        assert torch.equal(RemoteReward(served.url, api_key="s3cret")(["a", "b"], x),
                           reward(["a", "b"], x))
        monkeypatch.setenv("FLOWSEAM_REWARD_API_KEY", "s3cret")  # the key need not be in a config
        assert torch.equal(RemoteReward(served.url)(["a", "b"], x), reward(["a", "b"], x))
        health = httpx.get(f"http://127.0.0.1:{served.port}/health")  # open without a key
        assert health.status_code == 200 and health.json()["status"] == "ok"
    assert "without --api-key" in (exposure_warning("0.0.0.0", None) or "")
    assert exposure_warning("0.0.0.0", "k") is None and exposure_warning("127.0.0.1", None) is None


def test_bodies_are_json_and_anything_else_is_refused():
    reward = get_reward("brightness")
    x = _frames(2)
    with Served(reward, "brightness") as served:
        good = encode_request(["a", "b"], x)  # what RemoteReward sends
        # what the client sends: JSON text, the samples as a safetensors file in base64
        blob = base64.b64decode(good["outputs"]["data"])
        assert blob[8:9] == b"{" and json.loads(json.dumps(good)) == good
        ok = httpx.post(served.url, json=good)
        assert ok.status_code == 200 and ok.headers["content-type"] == "application/json"
        assert ok.json() == {"scores": [float(v) for v in reward(["a", "b"], x)]}
        described = httpx.get(served.url).json()
        assert described["name"] == "brightness" and described["modality"] == "video"
        assert described["max_batch"] == 64 and described["formats"][0] == "safetensors"

        def post(content=None, ctype="application/json", **kw):
            r = httpx.post(served.url, content=content, headers={"content-type": ctype}, **kw)
            assert r.headers["content-type"] == "application/json", r.text
            return r.status_code, r.json()["error"]

        status, err = post(pickle.dumps({"prompts": ["a"], "outputs": x}),
                           "application/octet-stream")
        assert status == 415 and err["field"] == "body" and "application/json" in err["message"]
        status, err = post(pickle.dumps({"prompts": ["a"]}))  # a pickle that claims to be JSON
        assert status == 400 and err["field"] == "body"
        status, err = post(json.dumps({"prompts": ["a", "b"]}))
        assert status == 400 and err["field"] == "outputs"
        status, err = post(json.dumps({**good, "prompts": "ab"}))
        assert status == 400 and err["field"] == "prompts"
        status, err = post(json.dumps({**good, "outputs": {"format": "pickle", "data": "eA=="}}))
        assert status == 400 and err["field"] == "outputs.format"
        assert "safetensors" in err["message"]
        status, err = post(json.dumps({**good, "outputs": {"format": "safetensors", "data": "@@"}}))
        assert status == 400 and err["field"] == "outputs.data"
        status, err = post(json.dumps({**good, "prompts": ["a", "b", "c"]}))
        assert status == 400 and err["field"] == "outputs" and "B = 3" in err["message"]
        status, err = post(json.dumps({**good, "extra": 1}))
        assert status == 400 and err["field"] == "extra"
        status, err = post(b"[" * 100_000)  # nested past Python's recursion limit
        assert status == 400 and err["field"] == "body" and "nested too deeply" in err["message"]
        r = httpx.post(served.url.replace("brightness", "ocr"), json=good)
        assert r.status_code == 404 and "'brightness'" in r.json()["error"]["message"]
    with Served(reward, "brightness", max_body_bytes=1000) as served:
        r = httpx.post(served.url, json=good)
        assert r.status_code == 413 and "--max-body-mb" in r.json()["error"]["message"]
    # a small PNG of a huge blank image: refused as it would decode past the body limit
    blank = encode_request(["a"], np.zeros((1, 1, 1000, 1000, 3), np.float32), "png")
    assert len(json.dumps(blank)) < 20_000
    with Served(reward, "brightness", max_body_bytes=100_000) as served:
        r = httpx.post(served.url, json=blank)
        assert r.status_code == 413 and r.json()["error"]["field"] == "outputs.frames[0][0]"
    for module in ("wire", "reward_server", "remote"):
        source = (Path(flowseam.__file__).parent / "rewards" / f"{module}.py").read_text()
        assert "import pickle" not in source and "pickle.load" not in source


# -- retries, a server that stays down, a reward that fails --------------------------------------
def test_a_server_that_comes_up_within_the_retries_is_used():
    reward = get_reward("brightness")
    probe = bind("127.0.0.1", 0)
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    started: list[Served] = []
    timer = threading.Timer(0.4, lambda: started.append(Served(reward, "brightness", port=port)))
    timer.start()
    try:
        x = _frames(2)
        got = RemoteReward(f"http://127.0.0.1:{port}/brightness", retries=8, backoff=0.05)(
            ["a", "b"], x)
        assert torch.equal(got, reward(["a", "b"], x))
    finally:
        timer.join()
        for s in started:
            s.stop()


class Overloaded:
    """An ASGI proxy in front of the server that answers its first ``n`` POSTs with 503 (as a
    busy load balancer does)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, app):
        async def proxy(scope, receive, send):
            if scope["type"] == "http" and scope["method"] == "POST" and self.n > 0:
                self.n -= 1
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"overloaded"})
                return
            await app(scope, receive, send)

        return proxy


def test_5xx_answers_are_retried_with_backoff(sleeps):
    reward = get_reward("brightness")
    x = _frames(2)
    with Served(reward, "brightness", front=Overloaded(2)) as served:
        got = RemoteReward(served.url, retries=3, backoff=0.01)(["a", "b"], x)
        assert torch.equal(got, reward(["a", "b"], x)) and sleeps == [0.01, 0.02]
        assert served.counts["requests"] == 1
    sleeps.clear()
    with Served(reward, "brightness", front=Overloaded(5)) as served:
        with pytest.raises(RewardServerError, match=r"2 attempt\(s\).*HTTP 503: overloaded"):
            RemoteReward(served.url, retries=1, backoff=0.01)(["a", "b"], x)
    assert sleeps == [0.01]


def test_a_server_that_stays_down_raises_after_the_configured_attempts(sleeps):
    probe = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{probe.getsockname()[1]}/brightness"
    probe.close()
    with pytest.raises(RewardServerError) as info:
        RemoteReward(url, retries=2, backoff=0.01)(["a"], _frames(1))
    message = str(info.value)
    assert url in message and "3 attempt(s)" in message and "ConnectError" in message
    assert sleeps == [0.01, 0.02]  # exponential backoff

    def slow(prompts, outputs):
        time.sleep(0.6)
        return torch.zeros(len(prompts))

    sleeps.clear()
    with Served(slow, "slow") as served:
        # taken but not answered in time: not retried (a retry would queue behind it)
        with pytest.raises(RewardServerError, match=r"did not answer a POST within 0.2 s"):
            RemoteReward(served.url, timeout=0.2, retries=1, backoff=0.01)(["a"], _frames(1))
    assert sleeps == []


def test_a_reward_fault_on_the_server_is_named_and_not_retried(sleeps):
    def wrong(prompts, outputs):
        return torch.zeros(len(prompts) + 1)

    def raises(prompts, outputs):
        raise RuntimeError("model exploded")

    with Served(wrong, "wrong", origin={"plugin": "acme", "distribution": "acme-rewards",
                                         "version": "1.0"}) as served:
        with pytest.raises(RewardFaultError, match=r"reward 'wrong'.*plugin acme.*shape \(3,\)") \
                as info:
            RemoteReward(served.url)(["a", "b"], _frames(2))
        assert (info.value.plugin, info.value.distribution, info.value.what) == \
            ("acme", "acme-rewards", "reward wrong")
    with Served(raises, "raises") as served:
        with pytest.raises(RewardFaultError, match="RuntimeError: model exploded"):
            RemoteReward(served.url)(["a"], _frames(1))
    assert sleeps == []


def test_bad_client_arguments_are_refused_before_any_request():
    for kwargs, pattern in (
            ({"url": "ftp://127.0.0.1:1/ocr"}, r"scheme 'ftp'; allowed: http, https"),
            ({"url": "127.0.0.1:8100/ocr"}, "allowed: http, https"),
            ({"url": "http://127.0.0.1:8100"}, "must end in the served reward's name"),
            ({"url": "http://127.0.0.1:8100/a/b"}, "must end in the served reward's name"),
            ({"url": "http://127.0.0.1:port/ocr"}, "does not parse"),
            ({"timeout": 0}, r"timeout=0 must be a finite number of seconds > 0"),
            ({"timeout": float("nan")}, "timeout=nan"),
            ({"backoff": float("inf")}, "backoff=inf"),
            ({"retries": -1}, "retries=-1"),
            ({"retries": 1.5}, "retries=1.5"),
            ({"batch_size": 0}, "batch_size=0"),
            ({"format": "gif"}, "format='gif'"),
            ({"api_key": " "}, "api_key"),
            ({"api_key": "k3y\n"}, r"api_key .*holds a space, a newline .*\(the key is not "
                                   r"shown here\)$"),
    ):
        kwargs = {"url": "http://127.0.0.1:1/ocr", **kwargs}
        with pytest.raises(InvalidInputError, match=pattern):
            RemoteReward(**kwargs)
    # no request at construction: a URL nobody serves is fine until the first call
    assert RemoteReward("https://rewards.invalid:9/ocr").name == "ocr"


# -- the command --------------------------------------------------------------------------------
def test_reward_serve_refuses_bad_arguments_before_loading():
    r = run_main("reward-serve", "--reward", "nonexistent")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "unknown reward 'nonexistent'" in r.stderr and "'brightness'" in r.stderr
    for args, message in ((["--reward-args", "{nope"], "--reward-args '{nope' is not JSON"),
                          (["--reward-args", "[1]"], "must be a JSON object"),
                          (["--port", "70000"], "--port=70000 must be in [0, 65535]"),
                          (["--max-batch", "0"], "--max-batch=0 must be >= 1"),
                          (["--api-key", "k3y "], "--api-key (or FLOWSEAM_REWARD_API_KEY) "
                                                  "holds a space"),
                          (["--reward-args", '{"channel": 5}'], "channel=5 must be 0, 1 or 2")):
        # --port 0: the check must not depend on the default port being free on this machine
        r = run_main("reward-serve", "--reward", "channel_contrast", "--port", "0", *args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_reward_serve_names_a_factory_that_raises_as_a_plugin_fault(monkeypatch):
    """A registered reward whose factory raises (not InvalidInputError) is the plugin's fault,
    named as `flowseam train` names it, not an internal error of flowseam."""
    import flowseam.seam.reward_contract
    from flowseam.rewards.reward_server import RewardServeOptions, run

    def broken(name, **kwargs):
        raise RuntimeError("weights file truncated")

    monkeypatch.setattr(flowseam.seam.reward_contract, "get_reward", broken)
    with pytest.raises(RewardFaultError, match=r"reward 'brightness' of plugin 'methods' \(flowseam"
                                               r" .*\) raised RuntimeError: weights file truncated "
                                               r"while being built") as info:
        run(RewardServeOptions(reward="brightness", port=0))
    assert info.value.plugin == "methods" and isinstance(info.value.__cause__, RuntimeError)


def test_reward_serve_serves_an_installed_reward(monkeypatch):
    monkeypatch.setenv("FLOWSEAM_REWARD_API_KEY", "k")
    env = {**os.environ, "FLOWSEAM_REWARD_API_KEY": "k"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowseam", "reward-serve", "--reward", "channel_contrast",
         "--reward-args", '{"channel": 2}', "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, (line, proc.stderr.read())
        url = line.split("listening on ")[1].split()[0]
        assert url.endswith("/channel_contrast")
        remote = RemoteReward(url)
        described = remote.describe()
        assert (described["plugin"], described["distribution"]) == ("methods", "flowseam")
        assert described["modality"] == "video" and described["name"] == "channel_contrast"
        x = _frames(3)
        assert torch.equal(remote(["a", "b", "c"], x),
                           get_reward("channel_contrast", channel=2)(["a", "b", "c"], x))
        remote.close()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)  # reaps it and closes both pipes


# -- a run whose reward server dies ------------------------------------------------------------
@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    from flowseam.testing.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint("flux.1-t2i", tmp_path_factory.mktemp("reward-server") / "flux")


@pytest.fixture(scope="module")
def straight(flux, tmp_path_factory):
    """An uninterrupted 2-step run with the in-process reward: (its policy, its metrics)."""
    out = tmp_path_factory.mktemp("straight")
    run = _grpo(flux, output_dir=str(out))
    run.run(progress=False)
    return dict(run.stage.policy.named_parameters()), read_metrics(out / "metrics.jsonl")


def _grpo(flux, **over):
    cfg = dict(prompts=["a ball", "a box"], reward="brightness", group_size=2, steps=2, seed=0,
               sampling=SAMPLING, grpo=dict(beta=0.04, clip_range=0.2), optim=dict(lr=1e-3))
    cfg.update(over)
    return FlowGRPO(cfg, model=flowseam.load(flux, platform=flowseam.Platform("cpu")))


def _counting(method, after=None, kill=None):
    """Count ``method``'s steps; stop ``kill`` (a Served) after step ``after``."""
    steps, inner = [], method.train_step

    def train_step():
        record = inner()
        steps.append(method.step)
        if method.step == after:
            kill.stop()
        return record

    method.train_step = train_step
    return steps


@pytest.mark.parametrize("checkpoint_every", [1, 0])
def test_a_run_whose_reward_server_dies_stops_at_a_checkpoint_and_resumes(
        flux, straight, tmp_path, checkpoint_every):
    """Killed after step 1 of 2. With checkpoint_every = 1 the checkpoint of step 1 is there
    already; with 0 the run saves it as it stops (with the RNG states step 2 found)."""
    killed_after = 1
    brightness = get_reward("brightness")
    served = Served(brightness, "brightness")
    port, out = served.port, tmp_path / "remote"
    # what a config names: the server's URL, the client's arguments as reward_args
    config = dict(reward=served.url, reward_args={"retries": 2, "backoff": 0.01},
                  output_dir=str(out), checkpoint_every=checkpoint_every)
    run = _grpo(flux, **config)
    assert isinstance(run.reward.components[0].fn, RemoteReward)
    steps = _counting(run, after=killed_after, kill=served)
    with pytest.raises(RewardServerError) as info:
        run.run(progress=False)
    message = str(info.value)
    ckpt = out / "checkpoints" / f"step-{killed_after:06d}"
    assert served.url in message and "3 attempt(s)" in message
    assert f"the last complete checkpoint is {ckpt} (step {killed_after})" in message
    assert f"stopped before step {killed_after + 1} of 2" in message and "rerun" in message
    assert steps == list(range(1, killed_after + 1))
    assert latest_checkpoint(out / "checkpoints") == ckpt  # nothing of the failed step written
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == steps

    served = Served(brightness, "brightness", port=port)  # back on the same address
    try:
        again = _grpo(flux, **config)
        steps = _counting(again)
        again.run(progress=False)
    finally:
        served.stop()
    assert steps == [2]  # the remaining step, once
    weights, metrics = straight
    resumed = dict(again.stage.policy.named_parameters())
    assert all(torch.equal(weights[n], resumed[n]) for n in weights)  # as if it never went down
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rs]  # noqa: E731
    assert strip(read_metrics(out / "metrics.jsonl")) == strip(metrics)


def test_the_cli_exits_75_for_a_reward_server_that_stays_down(capsys):
    """EX_TEMPFAIL (sysexits.h: try again later), so a script tells "rerun once the server is up"
    from bad input (2) and a plugin fault (3) by the status alone; one line on stderr."""
    from flowseam.cli.boundary import report

    assert report(RewardServerError("reward server http://127.0.0.1:1/ocr failed 4 attempt(s)")) == 75
    err = capsys.readouterr().err
    assert err == "flowseam: reward server unavailable: reward server http://127.0.0.1:1/ocr " \
                  "failed 4 attempt(s)\n"
