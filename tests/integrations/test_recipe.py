"""The README's plain PyTorch recipe runs as written: tune leaves no trace, then accumulate at the knee."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

README = Path(__file__).resolve().parents[2] / "README.md"


def _recipe() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    found = [b for b in blocks if "# recipe: plain PyTorch" in b]
    assert len(found) == 1, "the README must hold exactly one plain PyTorch recipe"
    return found[0]


def test_readme_recipe_runs_and_keeps_the_global_batch(monkeypatch, tmp_path):
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path))
    code = _recipe()
    assert len(code.strip().splitlines()) <= 13
    # stop before training to check that tune left the model and optimizer as they were
    head, tail = code.split("for idx in", 1)
    ns: dict = {}
    exec(
        compile(
            head.replace(
                "result = microbatch.tune",
                "w0 = [p.clone() for p in model.parameters()]\nresult = microbatch.tune",
            ),
            "README",
            "exec",
        ),
        ns,
    )  # noqa: S102
    model, opt, b_m = ns["model"], ns["opt"], ns["b_m"]
    assert all(torch.equal(a, p) for a, p in zip(ns["w0"], model.parameters(), strict=True))
    assert opt.state == {} and all(p.grad is None for p in model.parameters())
    assert 256 % b_m == 0 and b_m <= 64
    rec = ns["result"].recommendation
    assert rec.grad_accum(b_m) * b_m == 256
    # the training loop: each step's gradient is the full 256-row batch's (accumulate is exact)
    exec(compile("for idx in" + tail, "README", "exec"), ns)  # noqa: S102
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(a, p) for a, p in zip(ns["w0"], model.parameters(), strict=True))
    assert opt.state[next(iter(model.parameters()))]["step"].item() == 3
