"""A test server speaking SGLang's native HTTP API, answered by the embedded engine.

Everything lives in `tests.sglang_server.app` (kept out of this file so that
`python -m tests.sglang_server.app` runs the module once).
"""
