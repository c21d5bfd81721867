"""``make book`` (llmlab/ops/book.py): what it stages for Sphinx.  CI builds the whole book (.ci/run)."""

import json

from llmlab.ops import book


def test_the_book_stages_the_course_and_shows_cluster_cells_unrun(tmp_path):
    src = book.stage(tmp_path / "src")
    assert (src / "conf.py").is_file() and "notebooks/*" in (src / "index.md").read_text()
    for part in book.PARTS:
        assert sorted(p.name for p in (src / part).glob("*.ipynb")) == \
            sorted(p.name for p in (book.ROOT / part).glob("*.ipynb"))
    cells = json.loads((src / "notebooks" / "08_distributed_serving.ipynb").read_text())["cells"]
    cluster = [c for c in cells if book.CLUSTER_ONLY in c["metadata"].get("tags", [])]
    assert cluster and all("skip-execution" in c["metadata"]["tags"] for c in cluster)
    assert not any("skip-execution" in c["metadata"].get("tags", []) for c in cells if c not in cluster)
    original = json.loads((book.ROOT / "notebooks" / "08_distributed_serving.ipynb").read_text())["cells"]
    assert [c["source"] for c in cells] == [c["source"] for c in original]  # nothing else changes
    (src / "notebooks" / "renamed_lesson.ipynb").write_text("{}")  # a lesson since renamed or deleted
    book.stage(tmp_path / "src")  # staging again starts from an empty folder
    assert not (src / "notebooks" / "renamed_lesson.ipynb").exists()
