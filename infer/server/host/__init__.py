"""The host: the engine's thread and its lifetime (:mod:`.state`, :mod:`.worker`), each
request's stream and its relay through a protocol's writer (:mod:`.stream`,
:mod:`.relay`), admission (:mod:`.admission`), metrics, resumable streams and stored
responses."""
