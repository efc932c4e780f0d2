"""The routes, one module per protocol (and :mod:`.ops` for operators): each view parses its
body with its protocol's model, admits it, and hands the stream to the protocol's writer.
No route module imports another."""
