"""A hard address-space limit the user set (``ulimit -v``, a batch system's) is kept, not raised: raising it is
refused, and every tune ended in "not allowed to raise maximum limit", even under 100 GB (a review, 2026-12-07)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CODE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (64 * 2**30, 64 * 2**30))  # hard and soft: the child inherits both
from microbatch.cli import main
sys.exit(main(["tune", "--model", "tiny", "--seq", "32", "--max-micro-batch", "4", "--repeats", "2", "--no-cache",
               "--json"]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS as Linux keeps it")
@pytest.mark.timeout(240)
def test_tune_runs_under_a_hard_address_space_limit(tmp_path):
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=220, cwd=tmp_path,
                       env={**__import__("os").environ, "MICROBATCH_CACHE_DIR": str(tmp_path / "c")})  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["micro_batch"] >= 1 and all(not p["oom"] for p in d["points"])
