"""The host: the served models and their lifetimes (:mod:`.registry`, :mod:`.state`), each
one's engine thread (:mod:`.worker`) or embedder (:mod:`.embedding`), each request's stream
and its relay through a protocol's writer (:mod:`.stream`, :mod:`.relay`), admission
(:mod:`.admission`), metrics, resumable streams and stored responses."""
