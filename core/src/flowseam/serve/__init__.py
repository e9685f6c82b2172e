"""``flowseam serve``: an OpenAI-compatible HTTP server for image and video jobs.

Split like vLLM's ``entrypoints/openai/``, so that a route is a few lines and the generation
worker knows nothing about HTTP: :mod:`.api_server` (the routes, authentication, upload limits),
:mod:`.protocol` (the request and response schemas, in OpenAI's shapes), :mod:`.engine` (one
worker per loaded model: batching, progress, cancellation, failures), :mod:`.jobs` (the SQLite
job table), :mod:`.prometheus` (``/metrics``), :mod:`.uploads` (reading an uploaded image),
:mod:`.ranks` (``--nproc``) and :mod:`.server` (the command: options, socket, model loading).
FastAPI on uvicorn, the ASGI stack vLLM and SGLang serve with; the same pydantic models validate
requests and document the API (``/docs``). For users: docs/serving.md.
"""
