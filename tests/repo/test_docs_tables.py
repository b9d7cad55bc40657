"""The option tables of the docs are rendered from the configs (``bench.tools.config_docs``):
a table edited by hand, or a config changed without rendering, fails here."""

import pytest

from bench.tools.config_docs import DOCS, ROOT, render


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_option_tables_are_rendered_from_the_configs(doc):
    text = (ROOT / doc).read_text()
    assert "<!-- options " in text
    assert render(text) == text, "stale option tables: run python -m bench.tools.config_docs"
