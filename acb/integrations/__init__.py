"""Ready pieces for embedding an acb engine in applications.

- :mod:`acb.integrations.aiohttp`: server-sent events and websocket handlers, and
  ``setup_engine`` tying an engine's lifetime to an aiohttp app.

Integrations use only the public API that ``acb/__init__.py`` exports.
"""
