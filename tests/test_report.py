"""The tables in docs/results are what bench.report makes of the raw results.json next to them (or of the
results-*.json of lanes that ran side by side, merged)."""

from pathlib import Path

import pytest

from openrlhf_oppo.bench import report

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
RUNS = sorted(p.parent for p in RESULTS.glob("*/table.md") if list(p.parent.glob("results*.json")))


@pytest.mark.parametrize("folder", RUNS, ids=[p.name for p in RUNS])
def test_committed_table_is_made_from_the_raw_results(folder, tmp_path):
    paths = sorted(folder.glob("results.json")) or sorted(folder.glob("results-*.json"))
    results = report.merge([str(p) for p in paths])
    assert results["machine"]["gpus"] and results["command"].startswith("python -m openrlhf_oppo.bench")
    assert report.table(results) == (folder / "table.md").read_text()
    report.write(results, str(tmp_path))
    assert (tmp_path / "breakdown.png").stat().st_size > 0 and (tmp_path / "timeline.png").stat().st_size > 0
