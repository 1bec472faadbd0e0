"""Shared fixtures: tiny in-process models (see acb.testing) and helpers."""

from __future__ import annotations

import os

import pytest

from acb.testing import tiny_model, tiny_tokenizer

# `acb serve` processes the tests start log no periodic throughput lines unless a test asks
os.environ.setdefault("ACB_LOG_INTERVAL", "0")


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def llama():
    return tiny_model("llama")

