"""The data tests' built-in corpus fixture, for the loader benchmark's test."""

from tests.data.conftest import builtin_corpus  # noqa: F401  (a pytest fixture)
