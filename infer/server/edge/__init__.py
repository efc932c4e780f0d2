"""The HTTP edge: errors in each protocol's dialect (:mod:`.errors`), keys, rates and CORS
(:mod:`.access`), the request guard and body limits (:mod:`.guard`), SSE and NDJSON framing
(:mod:`.framing`), reading a body and writing its answer (:mod:`.exchange`), and
``/openapi.json`` (:mod:`.openapi`)."""
