"""A local OpenAI-compatible (and Anthropic Messages) API over the engine, with continuous
batching. Engine-side: never imports Qt."""

from .batcher import Batcher, Completion
from .run import DEFAULT_HOST, DEFAULT_PORT, ApiServer, address, is_loopback

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "ApiServer", "Batcher", "Completion", "address", "is_loopback"]
