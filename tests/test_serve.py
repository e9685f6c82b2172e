"""``flowseam serve`` end to end: the real command (uvicorn on a free loopback port, tiny
checkpoints), driven by the official ``openai`` SDK; its outputs against ``flowseam generate``
byte for byte; cancel, 429, 401, 400/413, a job that runs out of memory, a restart after a crash,
and the web page in a real headless browser (Debian's chromium through Playwright).

The server runs with its data segment capped (``RLIMIT_DATA``, as on a smaller machine), so a
request too large for it fails with the CPU allocator's real out-of-memory error.
"""

from __future__ import annotations

import base64
import io
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flowseam.testing.tiny import write_tiny_checkpoint

openai = pytest.importorskip("openai", reason="the server tests need the openai SDK (test extra)")
pytestmark = [
    pytest.mark.slow,  # two server starts and a browser
    # the SDK marks its videos methods deprecated (OpenAI's hosted Sora API is being retired)
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),
]

KEY = "sk-flowseam-test"
#: the server's data-segment limit: far above what the tiny models use, far below what the
#: out-of-memory request asks for (a 1000-frame 512x512 first-frame condition, 3.1 GB)
DATA_LIMIT = 3 * 2**30
SMALL = {"steps": 2, "seed": 7}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (DATA_LIMIT, DATA_LIMIT))


class Server:
    """``python -m flowseam serve ... --port 0`` in a subprocess; (re)started and killed by the
    tests. Its log goes to a file (read for the port, shown when a test fails)."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.args, self.log_path = args, log
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 240.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWSEAM_")}
        self.log = open(self.log_path, "a")
        offset = self.log.tell()  # a restart appends to the same log: read only what is new
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flowseam", "serve", *self.args, "--port", "0",
             "--log-level", "warning"], stdout=self.log, stderr=subprocess.STDOUT, env=env,
            preexec_fn=_limit_memory)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_text()[offset:]
            if "listening on http://" in text:
                self.url = text.rsplit("listening on ", 1)[1].split()[0]
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"flowseam serve exited {self.proc.returncode}:\n{text}")
            time.sleep(0.2)
        else:
            raise RuntimeError(f"flowseam serve did not start in {timeout} s:\n"
                               + self.log_path.read_text())
        import httpx2 as httpx  # the openai SDK's HTTP client

        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("flowseam serve never became healthy:\n" + self.log_path.read_text())

    def kill(self) -> None:
        """SIGKILL: a crash, nothing runs on the way out."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.log.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()

    def client(self, key: str | None = KEY, **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or "none", max_retries=0,
                             timeout=300, **kw)

    def http(self, key: str | None = KEY):
        import httpx2 as httpx

        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=300)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-ckpt")
    return {c: write_tiny_checkpoint(c, root / c) for c in ("flux.1-t2i", "wan2.1-i2v",
                                                            "wan2.1-t2v")}


@pytest.fixture(scope="module")
def server(ckpts, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    srv = Server(["--model", str(ckpts["flux.1-t2i"]), "--model", str(ckpts["wan2.1-i2v"]),
                  "--model", str(ckpts["wan2.1-t2v"]), "--workflow", "t2i-i2v",
                  "--backend", "cpu", "--api-key", KEY, "--max-queue", "8",
                  "--output-dir", str(root / "out")], root / "server.log")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def first_frame(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serve-image") / "first.png"
    rng = np.random.RandomState(0)
    Image.fromarray((rng.rand(24, 40, 3) * 255).astype(np.uint8)).save(path)
    return path


def cli_generate(tmp_path: Path, name: str, *args: str) -> bytes:
    """Run ``flowseam generate`` (its real entry point, in this process) and return the bytes."""
    from flowseam.cli import main

    out = tmp_path / name
    assert main(["generate", *args, "--backend", "cpu", "--output", str(out)]) == 0
    return out.read_bytes()


def wait_progress(client, video_id: str, at_least: int = 1, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        video = client.videos.retrieve(video_id)
        if video.progress >= at_least or video.status not in ("queued", "in_progress"):
            return video
        time.sleep(0.05)
    raise AssertionError(f"{video_id} never reached {at_least}%")


def metric(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(f"{name}{labels} not in /metrics")


# -- the API -----------------------------------------------------------------------------------

def test_models_health_and_metrics(server):
    client = server.client()
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {"flux.1-t2i", "wan2.1-i2v", "wan2.1-t2v", "t2i-i2v"}
    flux = models["flux.1-t2i"].model_dump()
    assert flux["card"]["name"] == "flux.1-t2i" and flux["tasks"] == ["t2i"]
    assert flux["provenance"]["components"]["transformer"]["device"] == "cpu"
    assert flux["provenance"]["kernels"]["flow_match_step"].startswith("cpu:flow_match_step")
    assert models["t2i-i2v"].model_dump()["card"]["stages"] == ["flux.1-t2i", "wan2.1-i2v"]
    with server.http(key=None) as http:  # /health needs no key
        health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    with server.http() as http:
        text = http.get("/metrics").text
    assert metric(text, "flowseam_queue_depth", model="wan2.1-t2v") == 0
    assert metric(text, "flowseam_worker_up", model="flux.1-t2i") == 1
    assert metric(text, "flowseam_host_memory_rss_bytes") > 50 * 2**20
    assert metric(text, "flowseam_host_memory_available_bytes") > 0
    assert "# TYPE flowseam_gpu_memory_allocated_bytes gauge" in text
    assert "# TYPE flowseam_step_seconds histogram" in text
    assert metric(text, "flowseam_jobs", status="queued") >= 0


def test_images_generate_equals_flowseam_generate(server, ckpts, tmp_path):
    """client.images.generate: an image generated alone is byte-identical to `flowseam
    generate`'s PNG for the same seed and parameters (on cpu); a url answer serves the file;
    n=2 images use seeds seed and seed+1 (and ran as one batch)."""
    client = server.client()
    out = client.images.generate(model="flux.1-t2i", prompt="a red ball", size="32x48", n=2,
                                 extra_body={"seed": 5, "steps": 2})
    got = [base64.b64decode(d.b64_json) for d in out.data]
    assert [d.model_dump()["seed"] for d in out.data] == [5, 6]
    assert np.asarray(Image.open(io.BytesIO(got[1]))).shape == (48, 32, 3) and got[0] != got[1]
    url = client.images.generate(model="flux.1-t2i", prompt="a red ball", size="32x48",
                                 response_format="url", extra_body={"seed": 5, "steps": 2})
    with server.http() as http:
        fetched = http.get(url.data[0].url)
    want = cli_generate(tmp_path, "5.png", "--model", str(ckpts["flux.1-t2i"]), "--prompt",
                        "a red ball", "--width", "32", "--height", "48", "--steps", "2",
                        "--seed", "5")
    assert fetched.status_code == 200 and fetched.content == want
    # image 1 of the n=2 request ran in a batch of 2, equal to this one within float rounding
    # (tests/test_serve_engine.py checks batched samples against unbatched ones)
    a, b = (np.asarray(Image.open(io.BytesIO(x))).astype(int) for x in (got[0], want))
    assert np.abs(a - b).max() <= 1


def test_video_create_and_poll_equals_flowseam_generate(server, ckpts, tmp_path):
    """client.videos.create_and_poll + download_content: a playable MP4 of the requested frames,
    byte-identical to `flowseam generate`'s for the same seed and parameters."""
    import imageio.v3 as iio

    client = server.client()
    video = client.videos.create_and_poll(model="wan2.1-t2v", prompt="a dog runs",
                                          size="48x32", seconds="1",
                                          extra_body={"fps": 4, **SMALL})
    assert video.status == "completed" and video.progress == 100, video
    assert (video.size, video.seconds, video.model_dump()["frames"]) == ("48x32", "1", 5)
    content = client.videos.download_content(video.id).content
    frames = iio.imread(content, extension=".mp4")
    assert frames.shape == (5, 32, 48, 3)
    want = cli_generate(tmp_path, "t2v.mp4", "--model", str(ckpts["wan2.1-t2v"]),
                        "--prompt", "a dog runs", "--width", "48", "--height", "32",
                        "--frames", "5", "--fps", "4", "--steps", "2", "--seed", "7")
    assert content == want
    listed = [v.id for v in client.videos.list(limit=100)]
    assert video.id in listed


def test_image_to_video_and_workflow_equal_flowseam_generate(server, ckpts, first_frame,
                                                            tmp_path):
    """input_reference uploaded as a file (multipart), and the t2i-i2v workflow: both equal
    `flowseam generate --image` / `--workflow` byte for byte."""
    client = server.client()
    args = ["--width", "32", "--height", "32", "--frames", "5", "--steps", "2", "--seed", "7"]
    with open(first_frame, "rb") as f:
        i2v = client.videos.create_and_poll(model="wan2.1-i2v", prompt="it moves left",
                                            input_reference=f, size="32x32",
                                            extra_body={"frames": 5, **SMALL})
    assert i2v.status == "completed", i2v
    assert client.videos.download_content(i2v.id).content == cli_generate(
        tmp_path, "i2v.mp4", "--model", str(ckpts["wan2.1-i2v"]), "--image", str(first_frame),
        "--prompt", "it moves left", *args)
    flow = client.videos.create_and_poll(model="t2i-i2v", prompt="a cat", size="32x32",
                                         extra_body={"frames": 5, **SMALL})
    assert flow.status == "completed", flow
    assert client.videos.download_content(flow.id).content == cli_generate(
        tmp_path, "wf.mp4", "--workflow", "t2i-i2v", "--model", str(ckpts["flux.1-t2i"]),
        "--model", str(ckpts["wan2.1-i2v"]), "--prompt", "a cat", *args)
    data_url = "data:image/png;base64," + base64.b64encode(first_frame.read_bytes()).decode()
    with server.http() as http:  # JSON with a data: URL is the same request
        job = http.post("/v1/videos", json={"model": "wan2.1-i2v", "prompt": "it moves left",
                                            "size": "32x32", "frames": 5, "steps": 2, "seed": 7,
                                            "input_reference": {"image_url": data_url}}).json()
    done = client.videos.poll(job["id"], poll_interval_ms=50)
    assert client.videos.download_content(done.id).content == \
        client.videos.download_content(i2v.id).content


def test_concurrent_requests_are_batched(server):
    """Eight concurrent image requests from eight clients all finish once, with their own seeds;
    queued compatible ones ran together (fewer loop runs than requests)."""
    with server.http() as http:
        before = http.get("/metrics").text
    runs_before = metric(before, "flowseam_batch_size_count", model="flux.1-t2i")
    results: dict[int, bytes] = {}

    def one(seed: int) -> None:
        out = server.client().images.generate(model="flux.1-t2i", prompt="a ball", size="32x32",
                                              extra_body={"seed": seed, "steps": 3})
        results[seed] = base64.b64decode(out.data[0].b64_json)

    threads = [threading.Thread(target=one, args=(s,)) for s in range(100, 108)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(results) == list(range(100, 108))
    assert len(set(results.values())) == 8
    with server.http() as http:
        after = http.get("/metrics").text
    runs = metric(after, "flowseam_batch_size_count", model="flux.1-t2i") - runs_before
    assert 1 <= runs < 8


# -- refusals ------------------------------------------------------------------------------------

def test_auth(server):
    with pytest.raises(openai.AuthenticationError) as err:
        server.client(key=None).models.list()
    assert err.value.status_code == 401 and "API key" in err.value.message
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").images.generate(model="flux.1-t2i", prompt="x")
    with server.http(key=None) as http:
        page = http.get("/")
        assert page.status_code == 401 and "Basic" in page.headers["www-authenticate"]
        assert http.get("/metrics").status_code == 401
        assert http.get("/v1/videos/video_" + "0" * 32).status_code == 401
        assert http.get("/", auth=("anyone", KEY)).status_code == 200


@pytest.mark.parametrize("call,status,param,match", [
    (dict(size="33x32"), 400, "size", "width=33 is not divisible by 16"),
    (dict(size="big"), 400, "size", "must look like WIDTHxHEIGHT"),
    (dict(quality="hd"), 400, "quality", "quality"),
    (dict(extra_body={"steps": 0}), 400, "steps", "greater than or equal to 1"),
    (dict(extra_body={"nonsense": 1}), 400, "nonsense", "does not implement this field"),
    (dict(extra_body={"lora": {"name": "x"}}), 400, "lora", "give 'PATH[:WEIGHT][@EXPERT]'"),
    (dict(extra_body={"lora": "x.safetensors:0.5"}), 400, "lora", "is not loaded for flux.1-t2i"),
    (dict(extra_body={"cache": {"threshold": 0.1}}), 400, "cache", "give 'NAME:THRESHOLD'"),
    (dict(extra_body={"cache": "fast:0.1"}), 400, "cache", "cache='fast' is unknown"),
    (dict(model="nope"), 400, "model", "model='nope' is not served here"),
    (dict(model="wan2.1-t2v"), 400, "model", "cannot serve this request"),
])
def test_bad_image_requests_name_the_field(server, call, status, param, match):
    kwargs = {"model": "flux.1-t2i", "prompt": "x", **call}
    with pytest.raises(openai.APIStatusError) as err:
        server.client().images.generate(**kwargs)
    assert err.value.status_code == status
    assert err.value.body["param"] == param and match in err.value.body["message"]


def test_bad_video_requests_name_the_field(server, first_frame):
    client = server.client()
    cases = [
        (dict(model="wan2.1-t2v", extra_body={"frames": 6}), "frames", "num_frames=6 is not"),
        (dict(model="wan2.1-t2v", seconds="3", extra_body={"fps": 5}), "seconds",
         "seconds=3 at fps=5 makes 16 frames"),
        (dict(model="wan2.1-i2v"), "input_reference", "send input_reference"),
        (dict(model="wan2.1-t2v", input_reference=("x.png", b"not an image", "image/png")),
         "input_reference", "not a readable"),
        (dict(model="t2i-i2v", input_reference=open(first_frame, "rb")), "input_reference",
         "draws its own first frame"),
    ]
    for kwargs, param, match in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.videos.create(prompt="x", **kwargs)
        assert err.value.body["param"] == param, (kwargs, err.value.body)
        assert match in err.value.body["message"], (kwargs, err.value.body)
    with server.http() as http:  # what the SDK cannot send: JSON with a URL reference
        answer = http.post("/v1/videos", json={
            "model": "wan2.1-i2v", "prompt": "x",
            "input_reference": {"image_url": "https://example.com/a.png"}})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "input_reference"
    assert "remote URLs are not fetched" in answer.json()["error"]["message"]
    big = b"\0" * (17 * 2**20)  # over the default --max-upload-mb 16
    with pytest.raises(openai.APIStatusError) as err:
        client.videos.create(prompt="x", model="wan2.1-i2v",
                             input_reference=("big.png", big, "image/png"))
    assert err.value.status_code == 413
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_" + "0" * 32)
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("../../jobs.sqlite3")


def test_cancel_and_a_full_queue(server):
    """DELETE cancels a running job (gone from the API; the worker's step counter stops) and a
    queued one; a full queue answers 429 with Retry-After; the model then serves the next job."""
    client = server.client()
    long = dict(model="wan2.1-t2v", prompt="slow", size="32x32",
                extra_body={"frames": 5, "steps": 400, "seed": 1})
    running = client.videos.create(**long)
    wait_progress(client, running.id, at_least=1)
    queued = [client.videos.create(**long) for _ in range(8)]  # --max-queue 8
    with pytest.raises(openai.RateLimitError) as err:
        client.videos.create(**long)
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert err.value.body["code"] == "queue_full"
    for job in queued:
        assert client.videos.delete(job.id).deleted
    assert client.videos.delete(running.id).deleted
    with pytest.raises(openai.NotFoundError) as err:
        client.videos.retrieve(running.id)
    assert "cancelled" in err.value.message

    def steps_done() -> float:
        with server.http() as http:
            return metric(http.get("/metrics").text, "flowseam_step_seconds_count",
                          model="wan2.1-t2v")

    time.sleep(0.5)  # the next step boundary has passed
    settled = steps_done()
    time.sleep(1.0)
    assert steps_done() == settled  # no step ran since
    with server.http() as http:
        text = http.get("/metrics").text
    assert metric(text, "flowseam_queue_depth", model="wan2.1-t2v") == 0
    assert metric(text, "flowseam_jobs_finished_total", model="wan2.1-t2v",
                  status="cancelled") >= 4
    after = client.videos.create_and_poll(model="wan2.1-t2v", prompt="next", size="32x32",
                                          extra_body={"frames": 5, **SMALL})
    assert after.status == "completed"


def test_out_of_memory_fails_the_job_and_the_server_keeps_serving(server, first_frame):
    """A request too large for the server's memory fails with the allocator's reason (never
    stays in_progress); the same model then serves the next request."""
    client = server.client()
    with open(first_frame, "rb") as f:
        big = client.videos.create_and_poll(model="wan2.1-i2v", prompt="huge", size="512x512",
                                            input_reference=f, poll_interval_ms=100,
                                            extra_body={"frames": 1001, **SMALL})
    assert big.status == "failed" and big.error.code == "out_of_memory", big
    assert "can't allocate memory" in big.error.message
    with open(first_frame, "rb") as f:
        small = client.videos.create_and_poll(model="wan2.1-i2v", prompt="small", size="32x32",
                                              input_reference=f, poll_interval_ms=100,
                                              extra_body={"frames": 5, **SMALL})
    assert small.status == "completed"
    with server.http(key=None) as http:
        assert http.get("/health").json()["status"] == "ok"


def test_restart_keeps_completed_jobs_and_fails_unfinished_ones(server):
    """SIGKILL while a job runs and one waits; the restarted server (same --output-dir) still
    serves a completed job's MP4 and reports the two others failed with "server restarted"."""
    client = server.client()
    done = client.videos.create_and_poll(model="wan2.1-t2v", prompt="kept", size="32x32",
                                         extra_body={"frames": 5, **SMALL})
    content = client.videos.download_content(done.id).content
    long = dict(model="wan2.1-t2v", prompt="slow", size="32x32",
                extra_body={"frames": 5, "steps": 400, "seed": 1})
    running = client.videos.create(**long)
    wait_progress(client, running.id, at_least=1)
    waiting = client.videos.create(**long)
    server.kill()
    server.start()
    client = server.client()
    assert client.videos.retrieve(done.id).status == "completed"
    assert client.videos.download_content(done.id).content == content
    for job in (running, waiting):
        again = client.videos.retrieve(job.id)
        assert again.status == "failed" and "server restarted" in again.error.message, again
    assert {running.id, waiting.id, done.id} <= {v.id for v in client.videos.list(limit=100)}


# -- the web page ------------------------------------------------------------------------------

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync"]


def test_web_page_generates_and_plays_a_video(server):
    """The page at /: prompt box, model choice, live progress from the denoising steps, and
    the result playing in the page, in Debian's chromium (headless) driven by Playwright. The
    browser answers the API key's Basic challenge, so every request the page makes is
    authenticated."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on this machine (scripts/test installs Debian's chromium with "
                    "apt-get where it can)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    with tempfile.TemporaryDirectory() as profile, sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=browser, headless=True, args=CHROMIUM_FLAGS,
            http_credentials={"username": "flowseam", "password": KEY})
        try:
            page = context.new_page()
            page.goto(server.url + "/")
            page.wait_for_function("document.querySelectorAll('#model option').length == 4")
            page.select_option("#model", "wan2.1-t2v")
            page.fill("#prompt", "a ball rolls")
            page.fill("#width", "32")
            page.fill("#height", "32")
            page.fill("#frames", "9")
            page.fill("#steps", "60")
            page.click("#generate")
            page.wait_for_function(
                "(() => { const v = document.querySelector('video#output');"
                " return v && v.readyState >= 2 && v.currentTime > 0 && !v.paused; })()",
                timeout=120_000)
            seen = page.evaluate("window.flowseamProgressSeen")
            duration, width = page.evaluate(
                "[document.querySelector('video#output').duration,"
                " document.querySelector('video#output').videoWidth]")
            status = page.inner_text("#status")
        finally:
            context.close()
    assert seen[-1] == 100 and any(0 < p < 100 for p in seen), seen  # live, from the steps
    assert seen == sorted(seen)
    assert width == 32 and duration == pytest.approx(9 / 8, abs=0.2)
    assert "Done: 9 frames at 8 fps" in status
