"""The OpenAI-compatible server (python -m dlmjax.serve): engine, HTTP API, command line."""
