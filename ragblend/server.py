"""Moved to :mod:`ragblend.serving` (``serving.app``: the routes; ``serving.protocol``: the
wire format; ``serving.worker``: the work queue); this name stays so that existing imports
keep working."""

from ragblend.serving.app import ROUTES, Metrics, create_app, is_loopback, serve  # noqa: F401
from ragblend.serving.protocol import MAX_MESSAGES, MAX_PARTS, MAX_TEXTS, ApiError  # noqa: F401
from ragblend.serving.requests import sampling  # noqa: F401
