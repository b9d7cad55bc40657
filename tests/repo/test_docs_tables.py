"""The option tables of the docs are rendered from the configs (``bench.tools.config_docs``):
a table edited by hand, or a config changed without rendering, fails here."""

import pytest

from bench.tools.config_docs import DOCS, ROOT, render


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_option_tables_are_rendered_from_the_configs(doc):
    text = (ROOT / doc).read_text()
    assert "<!-- options " in text
    assert render(text) == text, "stale option tables: run python -m bench.tools.config_docs"


def test_the_vocabulary_lists_every_option_of_every_config_and_where_it_is():
    """docs/baselines.md's "One vocabulary" table: one row per option name, naming exactly
    the optimizers whose config has it."""
    from dataclasses import fields

    from dobb.registry import OPTIMIZERS

    text = (ROOT / "docs" / "baselines.md").read_text()
    table = text.split("<!-- vocabulary -->")[1].split("<!-- /vocabulary -->")[0]
    rows = [line.split("|")[1:3] for line in table.strip().splitlines()[2:]]
    listed = {name.strip().strip("`"): where.strip() for name, where in rows}
    classes = {e.cls for e in OPTIMIZERS.values() if hasattr(e.cls, "Config")}
    having: dict[str, set[str]] = {}
    for cls in classes:
        for f in fields(cls.Config):
            having.setdefault(f.name, set()).add(cls.__name__)
    assert set(listed) == set(having)
    for name, where in listed.items():
        assert where == "all" or set(where.split(", ")) == having[name], name
        assert where != "all" or having[name] == {c.__name__ for c in classes}, name


def test_the_main_jobs_table_in_the_harness_doc_is_the_jobs_own_and_its_prose_holds():
    """docs/harness.md copies the main job's results table from benchmarks/compare/summary.md
    (the job writes it) and states three orderings of it in words: each holds on the job's
    JSON, so a rerun that changes them fails here until the prose is mended."""
    import json

    text = (ROOT / "docs" / "harness.md").read_text()
    copy = text.split("<!-- main-job table -->\n")[1].split("<!-- /main-job table -->")[0]
    assert copy.strip() and copy in (ROOT / "benchmarks" / "compare" / "summary.md").read_text()
    best = json.loads((ROOT / "benchmarks" / "compare" / "results.json").read_text())["best"]
    loss = {name: run["final_val_loss"] for name, run in best.items()}
    others = sorted(loss, key=loss.get)
    assert others[:2] == ["muon", "dobb"]  # "the recommended Dobb trails Muon and beats ..."
    assert {n for n in loss if loss[n] > loss["dobb_paper"]} == {"dion", "adamw"}
    state = {name: run["state_bytes_per_param"] for name, run in best.items()}
    assert max(state, key=state.get) == "dobb"  # "keeps the most state per parameter"
