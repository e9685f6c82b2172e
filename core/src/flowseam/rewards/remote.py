"""The client of a reward server (``flowseam reward-serve``): :class:`RemoteReward`, what
``reward = "http://127.0.0.1:PORT/NAME"`` in a training config builds (with ``reward_args`` as
its keyword arguments).

It follows the reward contract (:class:`flowseam.seam.RewardFunction`) like an in-process reward,
so a training method cannot tell the two apart: the same samples get the same scores, because the
default wire format (safetensors, :mod:`flowseam.rewards.wire`) carries the float32 frames
exactly. Requests go through ``httpx``, JSON only — never pickle. Its arguments, retries and
errors, for users: docs/rewards.md ("Reward server").
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch

from ..errors import InvalidInputError, RewardFaultError, RewardServerError
from . import wire

#: where the API key comes from when ``api_key`` is not given
API_KEY_ENV = "FLOWSEAM_REWARD_API_KEY"


class RemoteReward:
    """A reward scored by a reward server: ``RemoteReward("http://127.0.0.1:8100/ocr")(prompts,
    outputs) -> torch.Tensor (B,) float32`` (NaN where the reward cannot score a sample).

    Nothing is sent until the first call (or the first read of :attr:`modality`), which reads
    the server's description (``GET url``) once, for the reward's modality and the server's
    ``max_batch``; every batch of at most ``batch_size`` samples is then one ``POST url``.

    :param url: ``http://HOST:PORT/NAME`` or ``https://...``: the served reward's address.
    :param api_key: sent as ``Authorization: Bearer KEY`` (default: ``$FLOWSEAM_REWARD_API_KEY``,
        so the key need not be written into a config; none: no header).
    :param timeout: seconds per request, to connect and between bytes of the answer (finite,
        > 0). A request the server took but did not answer in time is not retried: the server
        scores one request at a time, so a retry would only queue behind the one it is still
        scoring; the error says to raise ``timeout``.
    :param retries: tries after the first (an integer >= 0), for a request that fails to
        connect or send, or gets a 5xx answer other than a reward fault. A 4xx answer (a bad
        request, a wrong API key, a batch over the server's ``--max-batch``) is not retried: the
        request itself is wrong.
    :param backoff: seconds before the first retry, doubled for each next one (finite, >= 0).
    :param batch_size: samples per request (an integer >= 1; default: the server's
        ``max_batch``).
    :param format: the wire format of the samples: ``"safetensors"`` (exact float32, the
        default), ``"png"`` (8-bit frames: exact only for frames already quantised to 1/255) or
        ``"mp4"`` (H.264, lossy); see :mod:`flowseam.rewards.wire`.
    :raises InvalidInputError: naming the argument that is not allowed (a URL that is not http(s)
        or names no reward, a non-finite or non-positive number, an unknown format); no request
        is made.
    """

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 60.0,
                 retries: int = 3, backoff: float = 0.5, batch_size: int | None = None,
                 format: str = "safetensors") -> None:
        self.url, self.name = _check_url(url)
        if api_key is None:
            api_key = os.environ.get(API_KEY_ENV) or None
        if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
            raise InvalidInputError(f"api_key={api_key!r} must be a non-empty string (or unset)")
        if api_key is not None and not all(33 <= ord(ch) <= 126 for ch in api_key):
            # httpx would refuse the header and put the key into the error message
            raise InvalidInputError(
                f"api_key (or ${API_KEY_ENV}) holds a space, a newline or a character that is not "
                "printable ASCII (a trailing newline of a key file?); a Bearer key is printable "
                "ASCII without spaces (the key is not shown here)")
        self.api_key = api_key
        self.timeout = _number("timeout", timeout, positive=True)
        self.backoff = _number("backoff", backoff, positive=False)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise InvalidInputError(f"retries={retries!r} must be an integer >= 0 (tries after "
                                    "the first)")
        self.retries = retries
        if batch_size is not None and (isinstance(batch_size, bool) or
                                       not isinstance(batch_size, int) or batch_size < 1):
            raise InvalidInputError(f"batch_size={batch_size!r} must be an integer >= 1 (or unset: "
                                    "the server's max_batch)")
        self.batch_size = batch_size
        if format not in wire.FORMATS:
            raise InvalidInputError(f"format={format!r} is not a wire format; use one of "
                                    f"{wire.FORMATS}")
        self.format = format
        self.__name__ = self.name  # how training errors name a reward
        self._description: dict[str, Any] | None = None
        self._client = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r})"

    # -- what the server serves ------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The server's description of the reward (``GET url``, read once): ``{"name",
        "modality", "plugin", "distribution", "version", "max_batch", "formats"}``.

        :raises RewardServerError: if the server cannot be reached through every retry, or
            answers with an error.
        """
        if self._description is None:
            body = self._request("GET", None)
            if not isinstance(body, dict) or body.get("modality") not in ("video", "audio") or \
                    not isinstance(body.get("max_batch"), int):
                raise RewardServerError(f"reward server {self.url} answered GET with "
                                        f"{wire._short(body)}; a flowseam reward server describes "
                                        "its reward (name, modality, max_batch)")
            self._description = body
        return self._description

    @property
    def modality(self) -> str:
        """``"video"`` (the reward scores frames) or ``"audio"`` (waveforms), as the server says."""
        return self.describe()["modality"]

    # -- scoring ------------------------------------------------------------------------------
    def __call__(self, prompts: list[str], outputs: np.ndarray) -> torch.Tensor:
        """Score ``outputs`` (frames ``(B, F, H, W, 3)`` float in [0, 1], or waveforms
        ``(B, C, S)`` for an audio reward) for ``prompts`` (B strings): ``(B,)`` float32.

        :raises RewardServerError: naming the URL, the attempts and the last error, when a batch
            cannot be scored through every retry, or the server refuses it (4xx).
        :raises RewardFaultError: when the served reward failed (raised, or returned something
            other than one score per sample); not retried.
        """
        prompts = list(prompts)
        x = np.asarray(outputs)
        if x.shape[:1] != (len(prompts),):
            raise InvalidInputError(f"outputs has shape {x.shape} for {len(prompts)} prompts; "
                                    "expected one sample per prompt")
        if not prompts:
            return torch.zeros(0)
        size = self.batch_size or self.describe()["max_batch"]
        if self.format != "safetensors" and self.modality == "audio":
            raise InvalidInputError(f"format={self.format!r} carries frames; reward "
                                    f"{self.name!r} scores audio: use format='safetensors'")
        scores = []
        for start in range(0, len(prompts), size):
            body = wire.encode_request(prompts[start:start + size], x[start:start + size],
                                       self.format)
            answer = self._request("POST", body)
            try:
                scores.append(wire.decode_scores(answer, len(body["prompts"])))
            except wire.WireError as exc:
                raise RewardServerError(f"reward server {self.url} answered with {exc}") from None
        return torch.from_numpy(np.concatenate(scores))

    # -- HTTP ---------------------------------------------------------------------------------
    def _http(self):
        import httpx

        with self._lock:
            if self._client is None:
                headers = {"Accept": wire.CONTENT_TYPE}
                if self.api_key:
                    headers["Authorization"] = f"Bearer {self.api_key}"
                self._client = httpx.Client(timeout=self.timeout, headers=headers)
                # closed with this object too: a dropped reward leaves no open socket behind
                weakref.finalize(self, self._client.close)
            return self._client

    def _request(self, method: str, body: dict | None) -> Any:
        """One request, retried (see the class docstring); the answer's JSON."""
        import httpx

        client = self._http()
        attempts, last = self.retries + 1, ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                if body is None:
                    response = client.request(method, self.url)
                else:
                    response = client.request(method, self.url, json=body)
            except httpx.ReadTimeout:  # sent, and the server is still at it: not retried
                raise RewardServerError(
                    f"reward server {self.url} did not answer a {method} within {self.timeout:g} s "
                    f"(attempt {attempt + 1} of {attempts}); it may still be scoring, and a retry "
                    "would queue behind it: raise timeout in reward_args, or check the server"
                ) from None
            except httpx.TransportError as exc:  # connect/write errors and connect timeouts
                last = f"{type(exc).__name__}: {exc or 'no answer'}"
                continue
            status = response.status_code
            answer = _json(response)
            if status < 400:
                if answer is None:
                    raise RewardServerError(
                        f"reward server {self.url} answered {method} with "
                        f"{response.headers.get('content-type') or 'an untyped body'}, not "
                        f"{wire.CONTENT_TYPE}: is it a flowseam reward server?")
                return answer
            err = answer.get("error") if isinstance(answer, dict) else None
            message = err.get("message") if isinstance(err, dict) else response.text[:200]
            if isinstance(err, dict) and err.get("type") == "reward_fault":
                raise RewardFaultError(
                    f"reward {self.name!r} served at {self.url} failed: {message}",
                    plugin=str(err.get("plugin", "?")),
                    distribution=str(err.get("distribution", "?")),
                    version=str(err.get("version", "?")), what=f"reward {self.name}")
            if status < 500:
                raise RewardServerError(
                    f"reward server {self.url} refused the {method} (HTTP {status}, a client "
                    f"error, not retried): {message}")
            last = f"HTTP {status}: {message}"
        raise RewardServerError(
            f"reward server {self.url} failed {attempts} attempt(s) (timeout {self.timeout:g} s "
            f"each, backoff from {self.backoff:g} s doubling); last error: {last}")

    def close(self) -> None:
        """Close the connection pool (a later call opens a new one)."""
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def __getstate__(self) -> dict[str, Any]:  # picklable for reward workers: no socket, lock
        state = dict(self.__dict__)
        state["_client"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _check_url(url: Any) -> tuple[str, str]:
    """``(url, reward name)``.

    :raises InvalidInputError: naming the URL and what is allowed.
    """
    if not isinstance(url, str):
        raise InvalidInputError(f"reward server URL {url!r} must be a string "
                                "http://HOST:PORT/NAME")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as exc:
        raise InvalidInputError(f"reward server URL {url!r} does not parse ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidInputError(f"reward server URL {url!r} has scheme {parts.scheme or 'none'!r}; "
                                "allowed: http, https (http://HOST:PORT/NAME)")
    if not parts.hostname:
        raise InvalidInputError(f"reward server URL {url!r} names no host "
                                "(http://HOST:PORT/NAME)")
    name = parts.path.strip("/")
    if not name or "/" in name or parts.query or parts.fragment:
        raise InvalidInputError(f"reward server URL {url!r} must end in the served reward's name "
                                "and nothing after it: http://HOST:PORT/NAME")
    return url.rstrip("/"), name


def _number(name: str, value: Any, positive: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        raise InvalidInputError(f"{name}={value!r} must be a finite number of seconds "
                                f"{'> 0' if positive else '>= 0'}")
    return float(value)


def _json(response) -> Any:
    """The response's JSON body, or None for a body that is not JSON."""
    if response.headers.get("content-type", "").split(";")[0].strip() != wire.CONTENT_TYPE:
        return None
    try:
        return response.json()
    except ValueError:
        return None
