"""What the tests share: a real server on a loopback port, engine gates, SSE parsing and
plain reference implementations to check the fast paths against."""
