"""`memory` shows the mixture-of-experts dimensions (issue 29): total and active parameters, E, top-k,
EP in its first line and JSON; c for context parallelism."""

from __future__ import annotations

import json

from microbatch.cli import main


def test_memory_names_experts_and_active_parameters(capsys):
    assert main(["memory", "--model", "mixtral-8x7b", "-p", "4", "-b", "1", "-e", "8", "-d", "8"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "46,702,792,704 parameters (12,879,925,248 active; E=8, top-k=2, EP=8)" in head
    assert (
        main(["memory", "--model", "mixtral-8x7b", "-p", "4", "-b", "1", "-e", "8", "-d", "8", "--json"]) == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert (d["total_params"], d["active_params"]) == (46_702_792_704, 12_879_925_248)
    assert main(["memory", "--model", "llama-3-8b", "-b", "1", "-c", "4", "-d", "2", "--seq", "32768"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert " c=4 " in head and "active" not in head
