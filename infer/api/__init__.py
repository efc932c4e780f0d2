"""The wire protocols, pure (no quart, no trio): a package per protocol (:mod:`.openai`,
:mod:`.responses`, :mod:`.native`) with its request models, their conversion into the one
:class:`~infer.api.engine_request.EngineRequest`, the builders of its bodies and events and
its writer; the fields they share, written once; chat replies read as they stream (reasoning,
tool calls). Adding a protocol: ``README.md`` here."""
