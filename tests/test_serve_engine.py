"""The engine behind ``flowseam serve`` in-process, on real tiny checkpoints: batching, cancelling
at a step boundary (and freeing the run's memory), stopping, a restart over a crashed table, and
expiry. The HTTP side is tests/test_serve.py."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch
from PIL import Image

import flowseam
from flowseam.serve.engine import BadRequest, Engine, JobRequest
from flowseam.serve.jobs import Job, JobStore, new_job_id
from flowseam.testing.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-engine-ckpt")
    cpu = flowseam.Platform("cpu")
    return {card: flowseam.load(write_tiny_checkpoint(card, root / card), platform=cpu)
            for card in ("flux.1-t2i", "wan2.1-t2v")}


@pytest.fixture
def engine(models, tmp_path):
    eng = Engine(models, tmp_path / "out", max_queue=8, max_batch=8, expire_after=3600)
    eng.start()
    yield eng
    eng.stop()


def wait_for(predicate, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def image_request(seed, steps=2, **kw):
    return JobRequest(kind="image", prompt=kw.pop("prompt", "a red ball"), model="flux.1-t2i",
                      width=32, height=32, steps=steps, seed=seed, **kw)


def live_tensors(shape):
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and tuple(o.shape) == shape)


def test_compatible_queued_requests_run_as_one_batch(engine, models):
    """While the worker is busy, three compatible requests (same model, size, steps; other
    seeds) queue up and run as one loop run of 3; a request with other steps runs alone. Every
    batched image equals the same request generated alone within one uint8 level."""
    busy = engine.submit(image_request(seed=0, steps=60))
    wait_for(lambda: engine.get(busy.id).status == "in_progress", what="the busy job to start")
    batched = [engine.submit(image_request(seed=s)) for s in (11, 12, 13)]
    other = engine.submit(image_request(seed=14, steps=3))
    done = [engine.future(j.id).result(timeout=300) for j in [busy, *batched, other]]
    assert [j.status for j in done] == ["completed"] * 5
    sizes = [s.value for s in engine.metrics.registry.collect() if s.name == "flowseam_batch_size"
             for s in s.samples if s.name.endswith("_sum")]
    counts = [s.value for s in engine.metrics.registry.collect() if s.name == "flowseam_batch_size"
              for s in s.samples if s.name.endswith("_count")]
    assert counts == [3.0] and sizes == [5.0], (counts, sizes)  # runs of 1, 3 and 1 samples

    model = models["flux.1-t2i"]
    params = flowseam.DiffusionParams(num_steps=2, height=32, width=32, seed=11)
    alone = model.generate(["a red ball"] * 3, params=params, seeds=[11, 12, 13]).frames
    for job, ref in zip(done[1:4], alone):
        got = np.asarray(Image.open(engine.output_path(job))).astype(int)
        want = flowseam.media.to_uint8(ref[0]).astype(int)
        assert np.abs(got - want).max() <= 1, job.id
    first, second = (np.asarray(Image.open(engine.output_path(j))) for j in done[1:3])
    assert np.abs(first.astype(int) - second.astype(int)).max() > 10  # the seed changes the image


def test_cancel_stops_at_the_next_step_and_frees_the_latents(engine):
    """DELETE on a running job: it leaves the API at once, the loop stops at the next step
    boundary (progress moves by at most one step after the cancel) and no tensor of the run's
    latent shape is left alive; the next job runs."""
    req = JobRequest(kind="video", prompt="a dog", model="wan2.1-t2v", width=48, height=32,
                     frames=17, steps=100, seed=1)
    shape = (1, 16, 5, 4, 6)  # (B, C, (17 - 1) / 4 + 1, 32 / 8, 48 / 8)
    job = engine.submit(req)
    wait_for(lambda: engine.get(job.id).progress >= 3, what="a few denoising steps")
    assert live_tensors(shape) > 0
    progress_at_cancel = engine.get(job.id).progress
    engine.delete(job.id)
    assert engine.get(job.id).status == "cancelled"  # gone from the API at once
    done = engine.future(job.id).result(timeout=60)
    assert done.status == "cancelled" and done.outputs == []
    assert done.progress - progress_at_cancel <= 1, (progress_at_cancel, done.progress)
    wait_for(lambda: engine.workers["wan2.1-t2v"].running == [], what="the worker to let go")
    gc.collect()
    assert live_tensors(shape) == 0
    after = engine.submit(JobRequest(kind="video", prompt="a cat", model="wan2.1-t2v",
                                     width=32, height=32, frames=5, steps=2, seed=2))
    assert engine.future(after.id).result(timeout=120).status == "completed"


def test_a_queued_job_is_cancelled_without_running(engine):
    busy = engine.submit(image_request(seed=0, steps=40))
    queued = engine.submit(image_request(seed=1, steps=5))
    engine.delete(queued.id)
    assert engine.future(queued.id).result(timeout=5).status == "cancelled"
    assert engine.future(busy.id).result(timeout=300).status == "completed"
    assert engine.store.get(queued.id).started_at is None


def test_stop_fails_running_and_queued_jobs(models, tmp_path):
    """Stopping the server stops the running loop at its next step: no job stays in_progress or
    queued; both are failed with the reason, in memory and in the table."""
    eng = Engine(models, tmp_path / "out")
    eng.start()
    running = eng.submit(image_request(seed=0, steps=400))
    queued = eng.submit(image_request(seed=1, steps=3))
    wait_for(lambda: eng.get(running.id).progress > 0, what="the first steps")
    eng.stop()
    for job in (running, queued):  # the engine's own job objects
        assert job.status == "failed" and job.error_code == "server_shutdown"
    store = JobStore(tmp_path / "out" / "jobs.sqlite3")
    assert {store.get(j.id).status for j in (running, queued)} == {"failed"}
    store.close()


def test_restart_marks_unfinished_jobs_failed(models, tmp_path):
    """Rows a crashed server left queued or in_progress are failed with "server restarted"."""
    store = JobStore(tmp_path / "out" / "jobs.sqlite3")
    left = [Job(id=new_job_id("video"), kind="video", model="wan2.1-t2v", prompt="p",
                status=status, params={}) for status in ("queued", "in_progress", "completed")]
    for job in left:
        store.insert(job)
    store.close()
    eng = Engine(models, tmp_path / "out")
    eng.start()
    try:
        assert sorted(eng.restarted_jobs) == sorted(j.id for j in left[:2])
        for job in left[:2]:
            row = eng.get(job.id)
            assert row.status == "failed" and row.error_code == "server_restarted"
            assert "server restarted" in row.error_message
        assert eng.get(left[2].id).status == "completed"
    finally:
        eng.stop()


def test_finished_outputs_expire(models, tmp_path):
    """--expire-after: the reaper deletes a finished job's files after that many seconds and the
    job answers as expired."""
    eng = Engine(models, tmp_path / "out", expire_after=4.0)
    eng.start()
    try:
        job = eng.future(eng.submit(image_request(seed=3)).id).result(timeout=120)
        path = eng.output_path(job)
        assert job.status == "completed" and path.is_file()
        assert job.expires_at == pytest.approx(job.completed_at + 4.0)
        wait_for(lambda: eng.get(job.id).status == "expired", timeout=30, what="expiry")
        assert not path.exists() and eng.get(job.id).outputs == []
    finally:
        eng.stop()


def test_bad_values_are_refused_before_queueing(engine):
    with pytest.raises(BadRequest, match="num_frames=6 is not of the form 4k\\+1") as err:
        engine.submit(JobRequest(kind="video", prompt="x", model="wan2.1-t2v", frames=6))
    assert err.value.param == "frames"
    with pytest.raises(BadRequest, match="lora=.*give 'PATH") as err:
        engine.submit(image_request(seed=0, extra={"lora": {"name": "x"}}))
    assert err.value.param == "lora"
    with pytest.raises(BadRequest, match="model='nope' is not served here") as err:
        engine.submit(JobRequest(kind="image", prompt="x", model="nope"))
    assert err.value.param == "model"
    assert engine.store.counts()["queued"] == 0


@pytest.mark.parametrize("args,match", [
    (["--port", "70000"], "--port=70000 must be in [0, 65535]"),
    (["--max-queue", "0"], "--max-queue=0 must be >= 1"),
    (["--threads", "0"], "--threads=0 must be >= 1"),
    (["--workflow", "nope"], "--workflow 'nope' is unknown"),
    (["--workflow", "t2i-i2v"], "needs a text-to-image and an image-to-video --model"),
    (["--model", "/nonexistent/ckpt"], "no model_index.json there"),
    (["--port", "IN_USE"], "cannot listen on 127.0.0.1:"),
])
def test_serve_command_refuses_bad_options_before_loading(args, match, models, tmp_path,
                                                         capsys):
    """`flowseam serve` with a bad option prints one line and exits 2 before loading a model."""
    import socket

    from flowseam.cli import main

    argv = ["serve", "--model", str(models["wan2.1-t2v"].path), "--output-dir", str(tmp_path)]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        argv += [str(busy.getsockname()[1]) if a == "IN_USE" else a for a in args]
        if "--model" in args:
            argv = argv[:1] + argv[3:]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1, err


def test_a_dead_worker_fails_what_it_held_and_health_says_so(models, tmp_path, monkeypatch):
    """If a worker thread dies (a bug in flowseam, simulated by a run that raises outside the
    loop's own error handling), the job it ran and the jobs it queued are failed with the reason,
    /health's view reports it, and new requests for that model are refused (503)."""
    from flowseam.serve.engine import ModelWorker, Unavailable

    eng = Engine(models, tmp_path / "out")
    worker = eng.workers["flux.1-t2i"]
    gate = __import__("threading").Event()

    def broken_run(self, batch):
        gate.wait(30)
        raise RuntimeError("a bug in the worker")

    monkeypatch.setattr(ModelWorker, "_run", broken_run)
    eng.start()
    try:
        held = [eng.submit(image_request(seed=s, steps=5 + s)) for s in range(2)]
        gate.set()
        done = [eng.future(j.id).result(timeout=30) for j in held]
        assert [j.status for j in done] == ["failed", "failed"]
        assert all(j.error_code == "worker_stopped" and "a bug in the worker" in j.error_message
                   for j in done)
        assert eng.healthy()["flux.1-t2i"].startswith("worker stopped: RuntimeError")
        assert eng.healthy()["wan2.1-t2v"] == "ok"
        with pytest.raises(Unavailable, match="is not running"):
            eng.submit(image_request(seed=9))
        assert not worker.is_alive()
    finally:
        eng.stop()


def test_every_loop_calls_the_step_callback_after_each_step(models):
    """The loop API's step callback (what progress and cancellation hang on): every registered
    loop takes it; the flow-match loop calls it once per step, in order, with the latents that
    step produced; an exception it raises stops the loop and propagates."""
    import inspect

    from flowseam.loops import LOOPS, run_loop
    from flowseam.request import GenerationRequest, TaskType

    for name, loop in LOOPS.items():
        assert "step_callback" in inspect.signature(loop).parameters, name
    calls = []
    request = GenerationRequest("a ball", TaskType.T2I, flowseam.DiffusionParams(
        num_steps=3, height=32, width=32, seed=0))
    result = run_loop(models["flux.1-t2i"], request,
                      step_callback=lambda i, n, x: calls.append((i, n, x.clone())))
    assert [(i, n) for i, n, _ in calls] == [(0, 3), (1, 3), (2, 3)]
    assert torch.equal(calls[-1][2], result.latents)
    assert not torch.equal(calls[0][2], calls[1][2])

    class Stop(Exception):
        pass

    def stop_after_first(i, n, x):
        raise Stop(i)

    with pytest.raises(Stop) as err:
        run_loop(models["flux.1-t2i"], request, step_callback=stop_after_first)
    assert err.value.args == (0,)


def test_lora_and_cache_fields_run_as_flowseam_generate_runs_them(tmp_path):
    """A job naming a LoRA loaded at start (``flowseam serve --lora``) and a cache policy gives
    the image ``model.generate`` gives with the same parameters (within one uint8 level), moves
    the image away from the base model's, and records both in the job; a LoRA the server did not
    load is refused (the server never reads a path a client sends)."""
    import diffusers

    from flowseam.serve.server import preload_loras
    from test_adapters import FLUX_TARGETS, lora_layers

    path = write_tiny_checkpoint("flux.1-t2i", tmp_path / "flux")
    model = flowseam.load(path, platform=flowseam.Platform("cpu"))
    layers = lora_layers(diffusers.FluxTransformer2DModel.from_pretrained(path / "transformer"),
                         4, 1, FLUX_TARGETS)
    diffusers.FluxPipeline.save_lora_weights(tmp_path, transformer_lora_layers=layers,
                                             weight_name="style.safetensors")
    preload_loras({"flux.1-t2i": model}, [str(tmp_path / "style.safetensors")])
    eng = Engine({"flux.1-t2i": model}, tmp_path / "out", max_queue=8, max_batch=8,
                 expire_after=3600)
    eng.start()
    try:
        extra = {"lora": "style.safetensors:0.8", "cache": "extrapolate:0.2"}
        done = eng.future(eng.submit(image_request(seed=3, steps=6, extra=extra)).id).result(timeout=300)
        assert done.status == "completed", done.error
        assert done.params["lora"] == [{"name": "style.safetensors", "weight": 0.8, "expert": None}]
        assert done.params["cache"] == "extrapolate:0.2"
        params = flowseam.DiffusionParams(num_steps=6, height=32, width=32, seed=3)
        want = model.generate("a red ball", params=params.replace(
            lora=(f"{tmp_path / 'style.safetensors'}:0.8",), cache="extrapolate:0.2"))
        assert want.cache["steps_skipped"] > 0
        got = np.asarray(Image.open(eng.output_path(done))).astype(int)
        assert np.abs(got - flowseam.media.to_uint8(want.frames[0, 0]).astype(int)).max() <= 1
        base = flowseam.media.to_uint8(model.generate("a red ball", params=params).frames[0, 0])
        assert np.abs(got - base.astype(int)).max() > 10
        with pytest.raises(BadRequest, match="'other.safetensors' is not loaded") as err:
            eng.submit(image_request(seed=0, extra={"lora": "other.safetensors"}))
        assert err.value.param == "lora"
    finally:
        eng.stop()
