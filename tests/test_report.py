"""The tables in docs/results are what bench.report makes of the raw results.json next to them."""

from pathlib import Path

import pytest

from openrlhf_oppo.bench import report

RUNS = sorted((Path(__file__).resolve().parents[1] / "docs" / "results").glob("*/results.json"))


@pytest.mark.parametrize("path", RUNS, ids=[p.parent.name for p in RUNS])
def test_committed_table_is_made_from_the_raw_results(path, tmp_path):
    results = report.merge([str(path)])
    assert results["machine"]["gpus"] and results["command"].startswith("python -m openrlhf_oppo.bench")
    assert report.table(results) == (path.parent / "table.md").read_text()
    report.write(results, str(tmp_path))
    assert (tmp_path / "breakdown.png").stat().st_size > 0 and (tmp_path / "timeline.png").stat().st_size > 0
