"""What ``ray job submit --working-dir .`` uploads: the repository's files less what ``.gitignore`` and
``.rayignore`` exclude, judged by Ray's own exclusion code. The benchmarks' committed result files (figures, reports,
the studies' kept warm starts) grew the upload past 20 MB; a job needs none of them."""

import subprocess
from pathlib import Path

import pytest
from ray._private.runtime_env.packaging import get_excludes_from_ignore_files

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def uploaded_files() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    excludes = get_excludes_from_ignore_files(ROOT, include_gitignore=True)
    files = [ROOT / p for p in tracked.decode().split("\0") if p]
    return [f for f in files if f.is_file() and not any(ex(f) for ex in excludes)]


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_the_job_upload_is_the_sources_without_the_benchmark_results():
    files = uploaded_files()
    rel = {f.relative_to(ROOT).as_posix() for f in files}
    assert "driver/train.py" in rel and "configs/quickstart.yaml" in rel and "benchmarks/RESULTS.md" in rel
    assert not [r for r in rel if r.startswith("benchmarks/results/")]
    size = sum(f.stat().st_size for f in files)
    assert size < 5 * 2**20, f"a job upload of {size / 2**20:.1f} MiB"
