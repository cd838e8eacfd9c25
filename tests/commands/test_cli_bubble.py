"""`microbatch bubble` and `microbatch simulate`: JSON by value, diagrams, charts, bad input."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from _cli import run, run_json

from microbatch.show.text import normalize_rows, render_timeline_text, save_timeline_png, timeline_svg

# --- bubble ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "p,m,expected",
    [(4, 1, 0.75), (4, 4, 3 / 7), (4, 32, 3 / 35)],
)
def test_bubble_reproduces_the_seed(capsys, p, m, expected):
    d = run_json(["bubble", "--stages", str(p), "--microbatches", str(m)], capsys)
    assert d["bubble_fraction"] == pytest.approx(expected)
    assert d["bubble_ratio"] == pytest.approx((p - 1) / m)
    assert d["simulated_bubble_fraction"] == pytest.approx(expected)
    for key in (
        "schedule",
        "stages",
        "microbatches",
        "virtual",
        "bubble_fraction",
        "bubble_ratio",
        "peak_in_flight",
    ):
        assert key in d


def test_bubble_text_names_fraction_and_ratio(capsys):
    code, out, _ = run(["bubble", "-p", "4", "-m", "4"], capsys)
    assert code == 0
    assert re.search(r"bubble fraction\s+42\.9%\s+idle / total stage time", out)
    assert re.search(r"bubble ratio\s+75\.0%\s+idle / ideal busy time", out)
    assert "rank 3 |" in out and "\x1b[" not in out  # plain text when not a terminal


def test_bubble_in_flight_1f1b_and_gpipe(capsys):
    assert run_json(["bubble", "-p", "4", "-m", "8", "-s", "1f1b"], capsys)["peak_in_flight"] == [4, 3, 2, 1]
    assert run_json(["bubble", "-p", "4", "-m", "8", "-s", "gpipe"], capsys)["peak_in_flight"] == [8, 8, 8, 8]


def test_bubble_interleaved_ratio_and_pipeline_parallel_alias(capsys):
    d = run_json(
        ["bubble", "--pipeline-parallel", "8", "-m", "64", "-s", "interleaved-1f1b", "--virtual", "3"], capsys
    )
    assert d["stages"] == 8 and d["virtual"] == 3
    assert round(d["bubble_ratio"] * 100, 1) == 3.6
    assert d["bubble_fraction"] == pytest.approx(7 / (3 * 64 + 7))
    assert d["peak_in_flight"][0] == pytest.approx(8 + 7 / 3)


def test_bubble_zb_h1_says_default_times_and_is_a_third_of_1f1b(capsys):
    zb = run_json(["bubble", "-p", "4", "-m", "8", "-s", "zb-h1"], capsys)
    assert zb["times"] == {"forward": 1.0, "input": 1.0, "weight": 1.0}
    assert any("defaults" in n for n in zb["notes"])
    assert zb["idle_time_per_stage"] == pytest.approx(3.0)  # (p-1)(TF+TI-TW)
    # 1F1B with the same work (B = I + W = 2): idle (p-1)(TF+TB+TW) = 9, three times as much
    one = run_json(
        ["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--input-time", "1", "--weight-time", "1"], capsys
    )
    assert [s["idle"] for s in one["stage_stats"]] == [9.0] * 4
    zb2 = run_json(["bubble", "-p", "4", "-m", "8", "-s", "zb-h1", "--weight-time", "0.5"], capsys)
    assert zb2["idle_time_per_stage"] == pytest.approx(3 * 1.5)


def test_bubble_zb_h1_takes_the_m_pipeline_runs_and_simulates_below_p(capsys):
    """One rule with pipeline, torch's ScheduleInterleavedZeroBubble's: m < p runs there (one round) and is
    simulated here, where (p−1)(TF+TI−TW) does not hold; m = 5 at p = 2 (two rounds of uneven size), which
    torch's class refuses, is refused here too (before: bubble refused m = 1 and took m = 5)."""
    from microbatch.schedules.registry import generate
    from microbatch.schedules.simulate import simulate
    from microbatch.schedules.torch_order import torch_order

    d = run_json(["bubble", "-p", "2", "-m", "1", "-s", "zb-h1"], capsys)
    assert d["method"].startswith("simulation") and any("assumes m >= p" in n for n in d["notes"])
    assert d["idle_time_per_stage"] == pytest.approx(2.0)  # the closed form would say 1
    assert d["bubble_fraction"] == pytest.approx(2 / (2 + 3))
    order = torch_order("zb-interleaved", 4, 2, 1)
    ours = generate("zb-h1", 4, 2)
    assert [[str(a) for a in r] for r in ours.actions] == [order[r] for r in range(4)]
    sim = simulate(ours, forward_time=1, input_time=1, weight_time=1)
    assert run_json(["bubble", "-p", "4", "-m", "2", "-s", "zb-h1"], capsys)[
        "bubble_fraction"
    ] == pytest.approx(sim.bubble_fraction)
    code, _, err = run(["bubble", "-p", "2", "-m", "5", "-s", "zb-h1"], capsys)
    assert (
        code == 2 and "ScheduleInterleavedZeroBubble needs m to be a multiple of its number of rounds" in err
    )


# --- simulate ------------------------------------------------------------------------------


def test_simulate_json_keys_and_values(capsys):
    d = run_json(
        ["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--forward-time", "1", "--backward-time", "2"],
        capsys,
    )
    assert d["makespan"] == 33.0
    assert d["bubble_fraction"] == pytest.approx(9 / 33)
    assert d["closed_form"]["bubble_fraction"] == pytest.approx(d["bubble_fraction"])
    assert [s["stage"] for s in d["stage_stats"]] == [0, 1, 2, 3]
    assert [s["peak_in_flight"] for s in d["stage_stats"]] == [4, 3, 2, 1] == d["peak_in_flight"]
    assert all(s["busy"] == 24.0 and s["idle"] == 9.0 for s in d["stage_stats"])


def test_simulate_default_backward_is_twice_forward(capsys):
    d = run_json(["simulate", "-p", "2", "-m", "2", "-s", "gpipe", "--forward-time", "3"], capsys)
    assert d["times"]["backward"] == 6.0
    assert d["stage_stats"][0]["busy"] == 2 * (3 + 6)


def test_simulate_comm_time_and_stage_times(capsys):
    base = run_json(["simulate", "-p", "2", "-m", "1", "-s", "gpipe"], capsys)
    comm = run_json(["simulate", "-p", "2", "-m", "1", "-s", "gpipe", "--comm-time", "0.5"], capsys)
    assert comm["makespan"] == base["makespan"] + 1.0  # one hop forward, one back
    d = run_json(["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--stage-times", "1,1,2,1"], capsys)
    assert [s["busy"] for s in d["stage_stats"]] == [24.0, 24.0, 48.0, 24.0]
    e = run_json(["simulate", "-p", "2", "-m", "2", "-s", "zb-h1", "--stage-times", "1:1:0.5,2:2:1"], capsys)
    assert [s["busy"] for s in e["stage_stats"]] == [5.0, 10.0]


def test_simulate_writes_svg_and_png(capsys, tmp_path):
    svg, png = tmp_path / "t.svg", tmp_path / "t.png"
    code, out, err = run(
        [
            "simulate",
            "-p",
            "3",
            "-m",
            "4",
            "-s",
            "1f1b",
            "--svg",
            str(svg),
            "--png",
            str(png),
            "--no-diagram",
        ],
        capsys,
    )
    assert code == 0, err
    root = ET.parse(svg).getroot()
    rects = [e for e in root.iter() if e.tag.endswith("rect") and e.get("fill") in ("#4C78A8", "#54A24B")]
    assert len(rects) == 2 * 3 * 4 + 2  # one box per op, plus two legend swatches
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert f"wrote {svg}" in out


def test_simulate_zbv_v_placement(capsys):
    d = run_json(
        [
            "simulate",
            "-p",
            "4",
            "-m",
            "8",
            "-s",
            "zbv",
            "--virtual",
            "2",
            "--input-time",
            "1",
            "--weight-time",
            "1",
        ],
        capsys,
    )
    assert d["placement"] == "v"
    assert all(s["busy"] == 48.0 for s in d["stage_stats"])


# --- bad input: one line, exit 2, no traceback ---------------------------------------------

BAD = [
    (["bubble", "-p", "0", "-m", "4"], r"stages must be a whole number >= 1, got 0"),
    (["bubble", "-p", "4", "-m", "0"], r"microbatches must be a whole number >= 1, got 0"),
    (["bubble", "-p", "4", "-m", "4", "--virtual", "0"], r"virtual must be a whole number >= 1, got 0"),
    (
        ["bubble", "-p", "4", "-m", "4", "-s", "pipedream"],
        r"schedule 'pipedream' is unknown; known schedules: gpipe, 1f1b, interleaved-1f1b, zb-h1",
    ),
    (
        ["bubble", "-p", "4", "-m", "2", "-s", "1f1b"],
        r"torch's Schedule1F1B needs m >= p; use --microbatches 4 or more",
    ),
    (
        ["bubble", "-p", "4", "-m", "9", "-s", "interleaved-1f1b", "--virtual", "2"],
        r"torch's ScheduleInterleaved1F1B needs m to be a multiple",
    ),
    (["bubble", "-p", "4", "-m", "8", "-s", "gpipe", "--virtual", "2"], r"runs one stage per rank"),
    (
        ["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--forward-time", "-1"],
        r"--forward-time -1: an op time must be a finite number > 0",
    ),
    (
        ["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--backward-time", "inf"],
        r"--backward-time inf: an op time must be a finite number > 0",
    ),
    (
        ["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--comm-time", "nan"],
        r"--comm-time nan: an op time must be a finite number >= 0",
    ),
    (["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--forward-time", "0"], r"--forward-time 0: .* > 0"),
    (["bubble", "-p", "4", "-m", "8", "-s", "zb-h1", "--forward-time", "0"], r"--forward-time 0: .* > 0"),
    (["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--png", "out.svg"], r"--png out.svg: the suffix .svg"),
    (
        ["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--svg", "pyproject.toml/x.svg"],
        r"pyproject.toml is a file, not a folder",
    ),
    (
        ["simulate", "-p", "2", "-m", "2", "-s", "1f1b", "--svg", "out", "--png", "./out"],
        r"name one file: the PNG would replace",
    ),
    (
        # zbv builds max(m, 2p − 1) micro-batches: p, not m, is what to lower; and it has no closed form
        ["bubble", "-p", "1000", "-m", "1", "-s", "zbv", "--no-diagram"],
        r"--stages = 1000: zbv .* 11,994,000 actions.*use --stages 288 or fewer \(zbv has no closed form here",
    ),
    (
        ["simulate", "-p", "4", "-m", "1000000000", "-s", "1f1b"],
        r"8,000,000,000 actions, over the simulation limit of 1,000,000",
    ),
    (
        # outside its closed form's rule (T_W > T_I) DualPipeV is simulated, so a huge m is refused
        ["bubble", "-p", "4", "-m", "1000000000", "-s", "dualpipev", "--virtual", "2", "--weight-time", "2"],
        r"over the simulation limit",
    ),
    (
        [
            "memory",
            "--model",
            "tiny",
            "-b",
            "1",
            "--stages",
            "4",
            "--microbatches",
            "2",
            "--schedule",
            "1f1b",
        ],
        r"--microbatches = 2 < --stages = 4",
    ),
    (
        ["simulate", "-p", "4", "-m", "8", "-s", "zb-h1"],
        r"'zb-h1' splits the backward into I and W: --input-time and --weight-time are required",
    ),
    (
        ["simulate", "-p", "4", "-m", "8", "-s", "zb-h1", "--input-time", "1"],
        r"needs both --input-time and --weight-time; add --weight-time",
    ),
    (
        ["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--stage-times", "1,x,1,1"],
        r"--stage-times entry 1 is 'x'",
    ),
    (
        ["simulate", "-p", "4", "-m", "8", "-s", "1f1b", "--stage-times", "1,1"],
        r"--stage-times has 2 entries but the schedule has 4 virtual stages",
    ),
    (
        [
            "simulate",
            "-p",
            "4",
            "-m",
            "8",
            "-s",
            "1f1b",
            "--backward-time",
            "2",
            "--input-time",
            "1",
            "--weight-time",
            "1",
        ],
        r"not both",
    ),
]


@pytest.mark.parametrize("args,pattern", BAD, ids=[" ".join(a[1:]) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2(capsys, args, pattern):
    code, out, err = run(args, capsys)
    assert code == 2
    assert out == ""
    assert re.search(pattern, err), err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_bad_input_through_the_console_script():
    proc = subprocess.run(
        [sys.executable, "-m", "microbatch", "bubble", "-p", "4", "-m", "2", "-s", "1f1b"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_bubble_does_not_import_torch_or_matplotlib():
    code = (
        "import sys; from microbatch.cli import main; rc = main(['bubble','-p','4','-m','8','-s','1f1b']); "
        "assert rc == 0; bad = [m for m in ('torch', 'matplotlib', 'numpy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# --- report module on plain (measured-style) rows -------------------------------------------


def test_render_plain_rows_like_a_measured_timeline():
    rows = [[(0.0, 1.0, "F", 0), (1.5, 3.5, "B", 0)], [(1.0, 2.0, "F", 0), (2.0, 3.0, "B", 0)]]
    text = render_timeline_text(rows, 3.5, legend=True)
    lines = text.splitlines()
    assert lines[1].startswith("rank 0 |F0") and lines[2].startswith("rank 1 |")
    assert "." in lines[1]  # the idle gap 1.0-1.5 on rank 0
    assert "F forward" in lines[-1] and "B backward" in lines[-1]
    colored = render_timeline_text(rows, 3.5, color=True)
    assert "\x1b[" in colored
    assert re.sub(r"\x1b\[[0-9;]*m", "", colored).splitlines()[1] == lines[1].replace("-", " ")


def test_dict_rows_and_svg_escape():
    rows = [[{"start": 0, "end": 2, "kind": "F", "microbatch": 3}]]
    assert normalize_rows(rows) == [[(0.0, 2.0, "F", 3)]]
    svg = timeline_svg(rows, 2, title="a < b")
    assert "a &lt; b" in svg
    ET.fromstring(svg)


def test_png_from_plain_rows(tmp_path):
    p = save_timeline_png([[(0, 1, "F", 0), (1, 3, "B", 0)]], 3, tmp_path / "x.png")
    assert p.read_bytes()[:4] == b"\x89PNG"


def test_bubble_interleaved_m_below_p_is_the_one_round_closed_form(capsys):
    d = run_json(["bubble", "-p", "4", "-m", "3", "-s", "interleaved-1f1b", "--virtual", "2"], capsys)
    # the m >= p form 3/9 does not hold for m < p; one round of p·v + m − 1 = 10 chunk times, 6 of them work
    assert d["bubble_fraction"] == pytest.approx(4 / 10)
    assert d["bubble_ratio"] == pytest.approx(4 / 6)
    assert d["bubble_fraction"] == pytest.approx(d["simulated_bubble_fraction"])  # torch's order, simulated
    assert d["method"].startswith("closed form at m < p")
    assert any("the m >= p form (p−1)/(v·m+p−1) would say 33.3%" in n for n in d["notes"])


@pytest.mark.parametrize(("p", "v"), [(2, 2), (4, 3), (8, 2), (8, 4)])
def test_the_one_round_form_is_the_simulation_at_every_m_below_p(p, v, capsys):
    for m in range(1, p):
        d = run_json(["bubble", "-p", str(p), "-m", str(m), "-s", "interleaved", "--virtual", str(v)], capsys)
        assert d["bubble_fraction"] == pytest.approx(d["simulated_bubble_fraction"], abs=1e-12), (p, v, m)


def test_measured_rows_on_any_clock_are_drawn_from_their_first_start(tmp_path):
    base = 1.7e9  # e.g. wall-clock seconds
    rows = [
        [(base, base + 1, "F", 0), (base + 2, base + 4, "B", 0)],
        [(base + 1, base + 2, "F", 0), (base + 2, base + 2.5, "B", 0)],
    ]
    shifted = [[(s - base, e - base, k, mb) for s, e, k, mb in r] for r in rows]
    assert render_timeline_text(rows) == render_timeline_text(shifted, 4.0)
    assert render_timeline_text(rows, 4.0) == render_timeline_text(shifted)  # a duration is accepted too
    svg = timeline_svg(rows)
    assert ">1700000000<" not in svg and ">4<" in svg


def test_simulate_intervals_and_activation_timeline(capsys):
    d = run_json(["simulate", "-p", "2", "-m", "2", "-s", "1f1b", "--intervals"], capsys)
    assert d["intervals"][1] == [[1.0, 2.0, "1F0"], [2.0, 4.0, "1B0"], [4.0, 5.0, "1F1"], [5.0, 7.0, "1B1"]]
    assert d["activations"][0] == [[0.0, 0], [1.0, 1], [2.0, 2], [6.0, 1], [9.0, 0]]


# --- every --schedule choice comes from the one registry ------------------------------------


def test_schedule_choices_come_from_the_registry(capsys):
    import click

    from microbatch.commands.memory import cmd as memory_cmd
    from microbatch.commands.plan import cmd as plan_cmd
    from microbatch.schedules.registry import schedule_names

    def choices(cmd):
        opt = next(p for p in cmd.params if p.name == "schedule")
        assert isinstance(opt.type, click.Choice)
        return tuple(opt.type.choices)

    assert choices(memory_cmd) == schedule_names(in_flight=True)
    assert choices(plan_cmd) == ("auto", *schedule_names(in_flight=True))
    for command in ("bubble", "simulate", "pipeline"):
        code, out, _ = run([command, "--help"], capsys)
        assert code == 0
        listed = "".join(out.split())  # click may wrap a name at its hyphen ("zb-" / "interleaved")
        names = schedule_names(torch=True) if command == "pipeline" else schedule_names()
        assert all(n in listed for n in names), (command, listed)


def test_bubble_accepts_an_alias(capsys):
    d = run_json(["bubble", "-p", "4", "-m", "8", "-s", "interleaved", "--virtual", "2"], capsys)
    assert d["schedule"] == "interleaved-1f1b"


def test_bubble_closed_form_of_a_huge_m_builds_no_schedule(capsys):
    import time

    t0 = time.process_time()  # CPU time: what the answer cost, which a loaded machine does not stretch
    d = run_json(["bubble", "-p", "4", "-m", "1000000000"], capsys)
    assert time.process_time() - t0 < 5
    assert d["bubble_fraction"] == pytest.approx(3 / (1_000_000_000 + 3))
    assert d["peak_in_flight"] == [1_000_000_000] * 4
    assert d["simulated_bubble_fraction"] is None
    assert any("over the simulation limit of 1,000,000" in n for n in d["notes"])


def test_interleaved_without_virtual_says_it_is_1f1b_and_v_schedules_default_to_two(capsys):
    d = run_json(["bubble", "-p", "2", "-m", "4", "-s", "interleaved-1f1b", "--no-diagram"], capsys)
    assert d["virtual"] == 1 and any("give --virtual 2" in n for n in d["notes"])
    d = run_json(["bubble", "-p", "2", "-m", "4", "-s", "dualpipev", "--no-diagram"], capsys)
    assert d["virtual"] == 2 and d["peak_in_flight"] == [2.5, 2.5]  # 2p + 1 chunks of half a rank
    d = run_json(
        ["bubble", "-p", "2", "-m", "4", "-s", "interleaved-1f1b", "--virtual", "2", "--no-diagram"], capsys
    )
    assert d["virtual"] == 2 and not any("--virtual" in n for n in d["notes"])


@pytest.mark.parametrize(
    ("p", "m", "f", "i", "w"),
    [(2, 4, 1, 1, 1), (4, 8, 1, 1, 1), (3, 6, 2, 1, 0.5), (4, 9, 1, 2, 1), (5, 10, 1, 1, 2)],
)
def test_simulate_dualpipev_closed_form_against_its_own_simulation(capsys, p, m, f, i, w):
    d = run_json(
        ["simulate", "-s", "dualpipev", "-p", str(p), "-m", str(m), "--forward-time", str(f),
         "--input-time", str(i), "--weight-time", str(w)],
        capsys,
    )  # fmt: skip
    cf = d["closed_form"]
    idle = [s["idle"] for s in d["stage_stats"]]
    assert cf["exact"] == (w <= i)
    if cf["exact"]:  # every rank idles the closed form's time
        assert idle == pytest.approx([cf["idle_time_per_stage"]] * p)
    else:  # a lower bound outside T_W <= T_I
        assert min(idle) >= cf["idle_time_per_stage"] - 1e-9


def test_simulate_states_zb_h1s_closed_form_only_where_it_holds(capsys):
    """(p − 1)(T_F + T_I − T_W) is ZB-H1's idle at m >= p; below, torch runs one round and only the simulation
    speaks (it had printed the form at m < p, where the simulated idle differs)."""
    args = ["simulate", "--schedule", "zb-h1", "-p", "4", "--forward-time", "1", "--input-time", "1",
            "--weight-time", "1", "--json"]  # fmt: skip
    assert run_json([*args, "-m", "2"], capsys).get("closed_form") is None
    assert run_json([*args, "-m", "8"], capsys)["closed_form"]["idle_time_per_stage"] == 3.0
