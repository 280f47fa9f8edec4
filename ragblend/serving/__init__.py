"""``ragblend serve`` and its clients.

* :mod:`~ragblend.serving.protocol` — the wire format, written once: requests to prompts,
  usage, strategies, errors (no web framework needed);
* :mod:`~ragblend.serving.requests` — the server's request bodies as pydantic models, and their
  one conversion to :class:`~ragblend.core.decode.generate.SamplingParams`;
* :mod:`~ragblend.serving.options` — the server's limits, declared once;
* :mod:`~ragblend.serving.client` — :class:`RemoteEngine`, the engine's interface over HTTP;
* :mod:`~ragblend.serving.worker` — the queue of requests the model works through;
* :mod:`~ragblend.serving.app` — the OpenAI-compatible routes (needs the ``serve`` extra).

Layering: this package imports only :mod:`ragblend.core`; the integrations and the CLI import it.
"""
