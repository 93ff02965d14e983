"""A local OpenAI-compatible (and Anthropic Messages) API over the engine, with continuous
batching: batcher.py (the model's thread), api.py (HTTP), run.py (uvicorn), address.py.
Engine-side: never imports Qt; the package imports no MLX until a model is served."""
