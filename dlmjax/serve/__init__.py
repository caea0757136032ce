"""The OpenAI-compatible server (python -m dlmjax.serve): engine, layout, HTTP API, command line."""
