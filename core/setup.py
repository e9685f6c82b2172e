"""Dependencies of the ``flowseam`` distribution, computed at build time.

``flowseam`` depends on ``flowseam-cpu`` so that a plain ``pip install flowseam`` has a working CPU
path, while the cpu backend stays a separate distribution found only through the
``flowseam.plugins`` entry-point group. ``flowseam-cpu`` does *not* depend on ``flowseam`` (it is
only ever imported by flowseam's plugin loader), so there is no packaging cycle.

Built from a checkout (``pip install ./core``), ``plugins/cpu`` sits next to ``core``; the
requirement then points at that directory so that pip installs the checkout's backend instead of
looking for it on an index. Built from an sdist, it is an ordinary version requirement.
"""

from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
VERSION = "0.1.0"


def _plugin(name: str, dist: str, extras: str = "") -> str:
    local = HERE.parent / "plugins" / name
    if (local / "pyproject.toml").is_file():
        return f"{dist}{extras} @ {local.as_uri()}"
    return f"{dist}{extras}=={VERSION}"


setup(
    install_requires=[
        "pluggy>=1.5",
        "numpy>=1.24",
        "torch>=2.4",
        "diffusers>=0.35",
        "transformers>=4.51",
        "accelerate>=1.0",
        "safetensors>=0.4",
        "huggingface_hub>=0.34",
        "ftfy>=6",
        "tqdm>=4.66",
        "pyyaml>=6",
        "pillow>=10",
        "imageio>=2.31",
        "imageio-ffmpeg>=0.5",
        "psutil>=5.9",
        # typed, range-checked training configs (flowseam.training.config)
        "pydantic>=2",
        # flowseam serve: the ASGI stack, multipart uploads, /metrics
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "python-multipart>=0.0.9",
        "prometheus-client>=0.20",
        # the reward server's client (flowseam.rewards.remote): timeouts, retries, connection reuse
        "httpx>=0.27",
        # PyAV (its wheels ship ffmpeg with libx264 and AAC): MP4s with a sound track, and the
        # H.264 re-compression of LTX-2's image-to-video condition
        "av>=14",
        _plugin("cpu", "flowseam-cpu"),
    ],
    extras_require={
        "cuda": [_plugin("cuda", "flowseam-cuda", "[cupy]")],
        "accel": [_plugin("accel", "flowseam-accel")],
        "lora": ["peft>=0.13"],
        # rollout fleets (flowseam.training.fleet): rollout and reward workers as Ray actors
        "ray": ["ray>=2.40"],
        # openai: the official SDK drives the server tests (videos API from 2.3);
        # playwright: drives the system chromium for the web page test (no browser download)
        # the ocr reward: PaddleOCR's PP-OCRv4 models (ONNX), shipped inside the wheel
        "ocr": ["rapidocr-onnxruntime>=1.3"],
        # [logging] in a training config: TensorBoard event files, Weights & Biases
        "tensorboard": ["tensorboard>=2.14"],
        "wandb": ["wandb>=0.16"],
        "test": ["pytest>=8", "peft>=0.13", "ray>=2.40", "openai>=2.3", "playwright>=1.40",
                 "rapidocr-onnxruntime>=1.3", "tensorboard>=2.14", "wandb>=0.16"],
        # `flowseam demo`: the digits data and classifier (scikit-learn; threadpoolctl caps its
        # BLAS threads), the reward plot, LoRA
        # the text world (`flowseam demo --world text`): DejaVu fonts (matplotlib) and the ocr reward
        "demo": ["scikit-learn>=1.3", "threadpoolctl>=3.1", "matplotlib>=3.7", "peft>=0.13",
                 "rapidocr-onnxruntime>=1.3"],
    },
)
