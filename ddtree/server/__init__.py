"""OpenAI-compatible HTTP server for ddtree: ``ddtree serve`` or ``create_app(engine_factory, config)``."""

from ddtree.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
