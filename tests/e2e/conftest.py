"""Fixtures the end-to-end tests share."""

import pytest

from tests.helpers.corpus import blend_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """``blend_corpus`` with 512 ids: the padded vocabulary (a multiple of 128 x TP) is 512 at
    TP = 1, 2 and 4."""
    return blend_corpus(str(tmp_path_factory.mktemp("corpus")), vocab_size=512)
