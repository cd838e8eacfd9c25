"""``microbatch report``: one self-contained HTML file from saved results."""

from __future__ import annotations

import re
from typing import Any

import click

from microbatch.commands._common import emit, force_option, json_option

__all__ = ["cmd"]


@click.command("report")
@click.argument("results", nargs=-1, required=True, type=click.Path(dir_okay=True))
@click.option(
    "--out",
    "out_path",
    default="microbatch-report/report.html",
    show_default=True,
    help="HTML file to write; PNG figures go in <name>-figures/ beside it.",
)
@click.option("--title", default="microbatch report", show_default=True)
@click.option("--no-png", is_flag=True, help="Skip the PNG copies of the figures.")
@force_option
@json_option
def cmd(
    results: tuple[str, ...], out_path: str, title: str, no_png: bool, force: bool, as_json: bool
) -> None:
    """Build the report from RESULTS: JSON files that the commands write with --json (or a
    `tune --out` directory). tune gets its throughput and memory figures and its points; recommend,
    the table of its knee; plan (one GPU or several), its tables; simulate and pipeline, their
    bubble diagrams; validate, predicted against measured; any other command's result, a table of
    its fields. An interrupted tune says so, and every tune says why its search stopped.

    \b
    Example:
      microbatch tune --model small --json > tune.json
      microbatch plan --model llama-3-8b --gpu h100-sxm --global-batch 1024 \\
          --data-parallel 16 --pipeline-parallel 4 --json > plan.json
      microbatch report tune.json plan.json --out report.html

    The HTML embeds every figure as SVG: it needs no network and no other file.
    """
    from microbatch.commands._common import check_output_file
    from microbatch.show.html import build_report, load_results

    # each file read once, with its path (a bad input refused before the output's folder is made)
    loaded = [(src, kind, r) for src in results for kind, r in load_results([src])]
    if not loaded:
        load_results(results)  # its refusal: no results given
    inputs = [("RESULTS", r) for r in results]  # never written over, nor a file not ours without --force
    check_output_file(out_path, "--out", (".html", ".htm"), inputs=inputs, force=force)
    if not no_png:  # the PNGs go in <name>-figures/ beside it: nothing there that is not ours is replaced
        _check_figures_folder(out_path, force)
    from microbatch.errors import MicrobatchError

    try:
        rep = build_report(
            [_read_typed(kind, r, src) for src, kind, r in loaded],
            out_path,
            title=title,
            png=not no_png,
        )
    except MicrobatchError:
        raise  # the library's own refusal says what is wrong (a ConfigError is a ValueError too)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
        raise _unreadable(results, e) from None
    payload = {
        "html": str(rep.html_path),
        "figures": [str(p) for p in rep.png_paths],
        "sections": rep.sections,
    }
    emit(
        payload,
        as_json,
        lambda: (
            f"report written to {rep.html_path} ({', '.join(rep.sections)}); "
            + (
                f"{len(set(rep.png_paths))} PNG figures in {rep.png_paths[0].parent}"
                if rep.png_paths
                else "no PNG figures"
            )
        ),
    )


def _read_typed(kind: str, result: dict[str, Any], source: str) -> tuple[str, dict[str, Any]]:
    """A result as its typed report reads it, where it has one: a pipeline result (this version's or
    an earlier one's) goes through :class:`~microbatch.run.pipeline.report.PipelineReport`."""
    if kind != "pipeline":
        return kind, result
    from microbatch.errors import ConfigError
    from microbatch.run.pipeline.report import PipelineReport

    try:
        return kind, {**result, **PipelineReport.from_json(result).to_json()}
    except TypeError as e:  # the report's fields missing: name them, not the constructor
        missing = sorted(set(re.findall(r"'(\w+)'", str(e))) - set(result)) if "missing" in str(e) else []
        if not missing:
            raise
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ConfigError(
            f"{source}: a pipeline result without {shown}: not a pipeline's JSON as it wrote it; give the JSON "
            "`microbatch pipeline --json` wrote, unedited"
        ) from None


def _unreadable(results: tuple[str, ...], error: Exception) -> Exception:
    """A ConfigError naming the file whose content the report could not draw (each file is drawn
    alone, without figures, to a temporary folder, to find it) and what went wrong: a field of an
    unexpected type or value in a file that was edited or not written by microbatch."""
    import tempfile

    from microbatch.errors import ConfigError
    from microbatch.show.html import build_report, load_results

    culprit = None
    with tempfile.TemporaryDirectory(prefix="microbatch-report-check-") as tmp:
        for r in results:
            try:
                build_report(load_results([r]), f"{tmp}/one.html", png=False)
            except Exception:  # noqa: BLE001 - any failure points at this file
                culprit = r
                break
    what = f"{culprit}:" if culprit is not None else f"one of {', '.join(results)}:"
    reason = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
    return ConfigError(
        f"{what} a field holds a value of the wrong kind, so the report cannot be drawn ({reason}); give the "
        "JSON a microbatch command wrote with --json or --out, unedited"
    )


def _check_figures_folder(out_path: str, force: bool) -> None:
    """Refuse, without ``--force``, a ``<name>-figures`` folder beside the HTML that holds a file that is
    not one of ours (:func:`microbatch.envelope.is_ours`): the report writes its PNGs there, under names
    known only once the figures are drawn."""
    from pathlib import Path

    from microbatch.envelope import is_ours
    from microbatch.errors import ConfigError

    out = Path(out_path)
    folder = out.with_name(out.stem + "-figures")
    if folder.exists() and not folder.is_dir():
        raise ConfigError(
            f"--out {out_path}: the figures go in {folder}, which is a file, not a folder; move it, give --no-png, "
            "or another --out"
        )
    if force or not folder.is_dir():
        return
    # only a PNG can be replaced: the figures are PNGs
    theirs = sorted(p.name for p in folder.glob("*.png") if p.is_file() and not is_ours(p))
    if theirs:
        raise ConfigError(
            f"--out {out_path}: the figures go in {folder}, which holds files microbatch did not write "
            f"({', '.join(theirs[:3])}{', ...' if len(theirs) > 3 else ''}) that a figure could replace; give "
            "--force to write there anyway, --no-png, or another --out"
        )
