"""Moved to :mod:`ragblend.serving.client`; this name stays so that existing imports keep working.

Imported lazily (on first attribute access), so that ``ragblend.core`` itself never imports
the serving layer above it.
"""

_NAMES = ("Backend", "BACKENDS", "RemoteEngine", "RemoteError", "RemoteGeneration", "RemotePrompt")


def __getattr__(name: str):
    if name in _NAMES:
        from ragblend.serving import client

        return getattr(client, name)
    raise AttributeError(f"module 'ragblend.core.remote' has no attribute {name!r}")
