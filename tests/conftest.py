"""Shared fixtures: tiny in-process models (see acb.testing) and helpers."""

from __future__ import annotations

import pytest

from acb.testing import tiny_model, tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def llama():
    return tiny_model("llama")

