"""Ollama's API (``/api/*``), as Continue, Copilot Chat, Open WebUI and the ``ollama`` client
speak it: the request bodies and the engine requests they become (:mod:`.models`), what is
known of each served model (:mod:`.card`), the answers and NDJSON lines (:mod:`.bodies`), and
the writer of ``/api/generate`` and ``/api/chat`` (:mod:`.writer`).
"""
