"""What ``ray job submit --working-dir .`` uploads: the repository's files less what ``.gitignore`` and
``.rayignore`` exclude, judged by Ray's own exclusion code. The benchmarks' committed result files (figures, reports,
the studies' kept warm starts) grew the upload past 20 MB; a job needs none of them."""

import shutil
import subprocess
from pathlib import Path

import pytest
from ray._private.runtime_env.packaging import get_excludes_from_ignore_files

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def tracked_files() -> bytes | None:
    """``git ls-files -z`` of the checkout, or None where there is no git or git refuses the checkout."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    r = subprocess.run(["git", "-c", f"safe.directory={ROOT}", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    return r.stdout if r.returncode == 0 and r.stdout else None


def uploaded_files(tracked: bytes) -> list[Path]:
    excludes = get_excludes_from_ignore_files(ROOT, include_gitignore=True)
    files = [ROOT / p for p in tracked.decode().split("\0") if p]
    return [f for f in files if f.is_file() and not any(ex(f) for ex in excludes)]


def test_the_job_upload_is_the_sources_without_the_benchmark_results():
    tracked = tracked_files()
    if tracked is None:
        pytest.skip("needs the git checkout and git")
    files = uploaded_files(tracked)
    rel = {f.relative_to(ROOT).as_posix() for f in files}
    assert "driver/train.py" in rel and "configs/quickstart.yaml" in rel and "benchmarks/RESULTS.md" in rel
    assert not [r for r in rel if r.startswith("benchmarks/results/")]
    # the quickstart's shipped warm start (4.7 MiB) goes with it: a job of the quickstart starts from it
    assert "configs/warm_starts/quickstart/model.safetensors" in rel
    size = sum(f.stat().st_size for f in files)
    assert size < 10 * 2**20, f"a job upload of {size / 2**20:.1f} MiB"
