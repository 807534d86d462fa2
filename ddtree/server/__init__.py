"""OpenAI-compatible HTTP server for ddtree: ``ddtree serve`` or ``create_app(engine_factory, config)``."""

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str):
    # The app imports the web framework and the engine (seconds): only when asked for, so that the serve
    # command's flags (``ddtree.server.options``) build without them.
    if name in __all__:
        from ddtree.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'ddtree.server' has no attribute {name!r}")
