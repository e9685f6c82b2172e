"""``flowseam serve``: an OpenAI-compatible HTTP server for images and video jobs.

Split like vLLM's ``entrypoints/openai/``:

* :mod:`.api_server`: the routes (FastAPI on uvicorn), authentication, upload limits;
* :mod:`.protocol`: the request and response schemas, in OpenAI's shapes (pydantic);
* :mod:`.engine`: the work behind the routes: one worker per loaded model, batching, progress,
  cancellation, failures; it knows nothing about HTTP;
* :mod:`.jobs`: the SQLite job table; :mod:`.metrics`: ``/metrics``; :mod:`.uploads`: reading an
  uploaded image; :mod:`.server`: the command (options, socket, model loading, uvicorn).

FastAPI + uvicorn: the ASGI stack vLLM and SGLang serve with, kept up by large communities, with
request validation from the same pydantic models that document the API (``/docs``).
"""
