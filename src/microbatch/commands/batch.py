"""``microbatch batch``: solve B_global = b_m × g × d."""

from __future__ import annotations

import click

from microbatch.commands._common import check_batch_bound, emit, json_option

__all__ = ["cmd"]


@click.command("batch")
@click.option(
    "--global-batch",
    "-B",
    type=int,
    callback=check_batch_bound,
    help="B_global: sequences per optimizer step.",
)
@click.option(
    "--micro-batch",
    "-b",
    type=int,
    callback=check_batch_bound,
    help="b_m: sequences per forward/backward on one device.",
)
@click.option(
    "--grad-accum",
    "-g",
    type=int,
    callback=check_batch_bound,
    help="g: micro-batches per replica per optimizer step.",
)
@click.option(
    "--data-parallel",
    "-d",
    type=int,
    callback=check_batch_bound,
    help="d: data-parallel replicas (default 1 when two are missing).",
)
@json_option
def cmd(
    global_batch: int | None,
    micro_batch: int | None,
    grad_accum: int | None,
    data_parallel: int | None,
    as_json: bool,
) -> None:
    """Give three of B_global, b_m, g, d; print the fourth.

    \b
    Example: microbatch batch --global-batch 512 --micro-batch 8 --data-parallel 4
    prints g = 16. With pipelining, g = m × k (m micro-batches per flush, k flushes).
    """
    from microbatch.batch import check_batch_quantity, solve
    from microbatch.errors import ConfigError

    given = (global_batch, micro_batch, grad_accum, data_parallel)
    for name, v in zip(("global_batch", "micro_batch", "grad_accum", "data_parallel"), given, strict=True):
        if v is not None:  # each in range before the identity between them
            check_batch_quantity(name, v)
    if all(v is not None for v in given):
        b, m, g, d = (int(v) for v in given)  # type: ignore[arg-type]  # all given: checked just above
        if m * g * d != b:
            raise ConfigError(
                f"-B {b} != -b {m} × -g {g} × -d {d} = {m * g * d}; B_global = b_m × g × d must hold: "
                "give three of -B, -b, -g, -d and the fourth is derived"
            )
    cfg = solve(
        global_batch=global_batch, micro_batch=micro_batch, grad_accum=grad_accum, data_parallel=data_parallel
    )

    def render() -> str:
        return (
            f"B_global = b_m × g × d: {cfg.global_batch} = {cfg.micro_batch} × {cfg.grad_accum} × "
            f"{cfg.data_parallel}\n"
            f"  global batch     B = {cfg.global_batch}\n"
            f"  micro-batch    b_m = {cfg.micro_batch}\n"
            f"  grad-accum       g = {cfg.grad_accum}\n"
            f"  data-parallel    d = {cfg.data_parallel}"
        )

    emit(cfg.to_dict(), as_json, render)
