"""The batch identity ``B_global = b_m × g × d``.

``b_m`` (micro-batch) is how many sequences one device runs in one forward and backward;
``g`` (gradient accumulation) is how many micro-batches each data-parallel replica runs per
optimizer step — with pipelining ``g = m × k``: ``m`` micro-batches per pipeline flush and
``k`` flushes per step (``k = 1`` by default); ``d`` is the number of data-parallel replicas.
Source: seed 002, "What a micro-batch actually is"; Narayanan et al. 2021 §2.2 (``B = b·m·d``
per pipeline flush).

Given any three of the four, :func:`solve` derives the fourth, or raises a
:class:`~microbatch.errors.ConfigError` naming the values, the rule and the nearest valid choices.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from microbatch.errors import ConfigError, check_positive_int, plain_numbers

__all__ = [
    "BatchConfig",
    "DEFAULT_KNEE_TOLERANCE",
    "solve",
    "global_batch_of",
    "grad_accum_for",
    "per_replica",
    "check_data_parallel",
    "check_micro_batch",
    "check_batch_quantity",
    "MAX_BATCH",
    "divisors",
    "nearest_multiples",
    "first_micro_batch",
    "next_micro_batch",
    "LADDER_MIN_RATIO",
]

DEFAULT_KNEE_TOLERANCE = 0.15
"""τ of the knee, the one constant: the knee is the smallest b_m (the planner: the least memory) whose
throughput is within 15% of the best (``docs/knee.md`` gives the rule and why 0.15). ``tune``'s default
(``microbatch.choose.config.DEFAULT_TOLERANCE``) and the planner's
(``microbatch.predict.plan_config.PLAN_TOLERANCE``) are this value; it lives here, in the core, because
predict/ sits below choose/."""

MAX_BATCH = 10**9
"""Most sequences any batch quantity takes (B_global, b_m, g, d), in the library and on the command line. The choosers
enumerate the divisors of B / d (time grows with √B): ``plan`` took 0.7 s at B = 735,134,400 (1,344 divisors) and
4.4 s at B = 963,761,198,400 (6,720), and ``plan``/``batch`` at B = 10^20 never answered (2 cores, 2026-12-03;
``solve(global_batch=10**18 + 1)`` ran for minutes, 2026-12-06). The largest published global batches are tens of
thousands of sequences (65,536 for BERT with LAMB, You et al. 2020), four orders of magnitude below."""

_FIXES = {
    "global_batch": "give the sequences per optimizer step, e.g. global_batch 512",
    "micro_batch": "give the sequences per forward/backward on one device, e.g. micro_batch 8",
    "grad_accum": "give the micro-batches per replica per step, e.g. grad_accum 1 for none",
    "data_parallel": "give the data-parallel replicas, e.g. data_parallel 1 for one device",
}
"""The fix named by the error of a batch quantity that is not a whole number >= 1."""


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """A consistent choice of the four batch quantities."""

    global_batch: int
    """B_global: sequences the optimizer sees per step (the statistical choice)."""
    micro_batch: int
    """b_m: sequences per forward/backward on one device (the physical choice)."""
    grad_accum: int
    """g: micro-batches per replica per optimizer step (= microbatches × flushes when pipelined)."""
    data_parallel: int = 1
    """d: data-parallel replicas."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        for name, fix in _FIXES.items():
            check_batch_quantity(name, getattr(self, name), fix=fix)
        if global_batch_of(self.micro_batch, self.grad_accum, self.data_parallel) != self.global_batch:
            raise ConfigError(
                f"global batch {self.global_batch} != micro-batch {self.micro_batch} × grad-accum "
                f"{self.grad_accum} × data-parallel {self.data_parallel} = "
                f"{self.micro_batch * self.grad_accum * self.data_parallel}; the identity "
                "B_global = b_m × g × d must hold: give three of global_batch, micro_batch, grad_accum, data_parallel and derive the fourth"
            )

    @property
    def per_replica_batch(self) -> int:
        """Sequences each replica runs per optimizer step: b_m × g."""
        return self.micro_batch * self.grad_accum

    def microbatches(self, flushes: int = 1) -> int:
        """m, micro-batches per pipeline flush, when each step runs ``flushes`` flushes (g = m × k)."""
        check_positive_int("flushes", flushes)
        if self.grad_accum % flushes:
            raise ConfigError(
                f"grad-accum {self.grad_accum} is not divisible by flushes {flushes}; the rule is "
                f"g = m × k; choose flushes among {_fmt(divisors(self.grad_accum))}"
            )
        return self.grad_accum // flushes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def global_batch_of(micro_batch: int, grad_accum: int, data_parallel: int = 1) -> int:
    """B_global = b_m × g × d: the sequences the optimizer sees per step (seed 002)."""
    return micro_batch * grad_accum * data_parallel


def grad_accum_for(global_batch: int, micro_batch: int, data_parallel: int = 1) -> int:
    """g = B_global // (b_m × d): the micro-batches each replica runs per optimizer step, rounded down
    (0 when b_m × d > B_global). The one derivation of g; exact when ``g × b_m × d == B_global``
    (:class:`BatchConfig` and :func:`solve` check that and name the fix)."""
    return global_batch // (micro_batch * data_parallel)


def per_replica(global_batch: int, data_parallel: int = 1) -> int | None:
    """B_global / d, the sequences each replica runs per optimizer step (b_m × g), when d divides
    B_global; None when it does not (then no b_m gives B_global = b_m × g × d)."""
    return global_batch // data_parallel if global_batch % data_parallel == 0 else None


def check_data_parallel(global_batch: int, data_parallel: int) -> int:
    """B_global / d, the per-replica batch; :class:`ConfigError` naming the values, the rule and the nearest
    valid global batches and data-parallel sizes when d does not divide B_global."""
    B, d = global_batch, data_parallel
    per = per_replica(B, d)
    if per is None:
        lo, hi = (B // d) * d, (B // d + 1) * d
        raise ConfigError(
            f"global batch {B} is not divisible by data-parallel {d}; B_global = b_m × g × d needs "
            f"d | B; use global batch {' or '.join(str(x) for x in dict.fromkeys((lo or hi, hi)))}, or a "
            f"data-parallel among {divisors(B)[:12]}"
        )
    return per


def check_micro_batch(global_batch: int, micro_batch: int, data_parallel: int = 1) -> int:
    """g = B_global / (b_m × d) for a d that divides B_global; :class:`ConfigError` naming the values, the
    rule and the valid micro-batches when b_m does not divide the per-replica batch B/d."""
    B, d, b = global_batch, data_parallel, micro_batch
    per = B // d
    if per % b:
        raise ConfigError(
            f"micro-batch {b} does not divide the per-replica batch B/d = {B}/{d} = {per}; "
            f"B_global = b_m × g × d must hold; use a micro-batch among {divisors(per)}"
        )
    return grad_accum_for(B, b, d)


def check_batch_quantity(name: str, value: object, *, fix: str = "") -> int:
    """``value`` as an int if it is a whole number from 1 to :data:`MAX_BATCH`, else a :class:`ConfigError` naming
    it (a global batch, micro-batch, accumulation count or data-parallel size)."""
    v = check_positive_int(name, value, fix=fix)
    if v > MAX_BATCH:
        raise ConfigError(
            f"{name} {v:,} is over the limit of {MAX_BATCH:,} sequences (the choices enumerate divisors, so time "
            f"grows with the batch; published global batches are below 100,000); give {MAX_BATCH:,} or less",
            params=(name,),
        )
    return v


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    small: list[int] = []
    large: list[int] = []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


LADDER_MIN_RATIO = 1.5
"""The least step of the search's ladder of divisors (:func:`next_micro_batch`) but its last: two
probes closer than 1.5× measure a gain per doubling with the probes' noise multiplied by
1/log2(ratio) (×1.7 at 1.5×, ×2.8 at 9/7 = 1.29×)."""


def first_micro_batch(start: int, per_replica: int | None = None) -> int:
    """The first b_m the doubling search probes: ``start``, or with the per-replica batch B/d given the smallest
    divisor of it from ``start`` up (a b_m that divides no exact B_global is never chosen: probing it is time
    lost); ``start`` itself when none is (past B/d: the walk's check refuses it)."""
    if per_replica is None:
        return start
    return min((d for d in divisors(per_replica) if d >= start), default=start)


def next_micro_batch(b: int, per_replica: int | None = None) -> int | None:
    """The b_m the doubling search probes after ``b``: 2b; or, with the per-replica batch B/d given,
    a divisor of it (a b_m that divides no exact B_global = b_m × g × d cannot be chosen: probing it
    is time lost), the one nearest 2b among those ≥ 1.5 b (ties: the smaller), else B/d itself;
    None once b ≥ B/d.

    For B/d = 64 the ladder is 1, 2, 4, … 64; for 96: … 16, 32, 48, 96; for 63: 1, 3, 7, 21, 63;
    for 1000: 1, 2, 4, 8, 20, 40, 100, 200, 500, 1000."""
    if per_replica is None:
        return 2 * b
    if b >= per_replica:
        return None
    wide = [d for d in divisors(per_replica) if d >= LADDER_MIN_RATIO * b]
    if not wide:
        return per_replica
    return min(wide, key=lambda d: (abs(d - 2 * b), d))


def nearest_multiples(value: int, unit: int) -> list[int]:
    """The multiples of ``unit`` just below and just above ``value`` (one if ``value`` is a multiple), none past
    :data:`MAX_BATCH` (a suggestion the same check would refuse)."""
    below = (value // unit) * unit
    above = below + unit
    if below == value:
        return [value]
    return [v for v in (below, above) if unit <= v <= MAX_BATCH]


def _closest(choices: list[int], target: int, count: int = 3) -> list[int]:
    """The ``count`` values of ``choices`` closest to ``target`` (ties: the smaller first), sorted."""
    return sorted(sorted(choices, key=lambda c: (abs(c - target), c))[:count])


def _fmt(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def solve(
    *,
    global_batch: int | None = None,
    micro_batch: int | None = None,
    grad_accum: int | None = None,
    data_parallel: int | None = None,
) -> BatchConfig:
    """Derive the missing one of (B_global, b_m, g, d) from the other three.

    With all four given, checks the identity. With ``data_parallel`` missing and three others
    given it is derived like the rest; if two or more are missing, ``data_parallel`` defaults
    to 1 when it is one of them.
    """
    given = {
        "global_batch": global_batch,
        "micro_batch": micro_batch,
        "grad_accum": grad_accum,
        "data_parallel": data_parallel,
    }
    for name, v in given.items():
        if v is not None:
            given[name] = check_batch_quantity(name, v, fix=_FIXES[name])
    missing = [k for k, v in given.items() if v is None]
    if len(missing) >= 2 and "data_parallel" in missing:
        given["data_parallel"] = 1
        missing.remove("data_parallel")
    if len(missing) > 1:
        raise ConfigError(
            "give three of global_batch, micro_batch, grad_accum, data_parallel; missing: "
            + ", ".join(missing),
            params=tuple(given),
        )
    values = {k: v for k, v in given.items() if v is not None}
    if not missing:
        return BatchConfig(**values)
    want = missing[0]
    if want == "global_batch":
        b, g, d = values["micro_batch"], values["grad_accum"], values["data_parallel"]
        if b * g * d > MAX_BATCH:
            raise ConfigError(
                f"B_global = b_m × g × d = {b:,} × {g:,} × {d:,} = {b * g * d:,} is over the limit of {MAX_BATCH:,} "
                "sequences a global batch has; give smaller micro_batch, grad_accum or data_parallel",
                params=("micro_batch", "grad_accum", "data_parallel"),
            )
        values[want] = b * g * d
        return BatchConfig(**values)
    B = values["global_batch"]
    names = {"micro_batch": "micro-batch", "grad_accum": "grad-accum", "data_parallel": "data-parallel"}
    others = {k: v for k, v in values.items() if k != "global_batch"}
    unit = 1
    for v in others.values():
        unit *= v
    if B % unit:
        product = " × ".join(f"{names[k]} {v}" for k, v in others.items())
        # Nearest valid values of the global batch, and of each other factor for this B.
        near_b = nearest_multiples(B, unit)
        fixes = [
            f"nearest valid global batches: {_fmt(near_b)}"
            if near_b
            else f"no global batch up to the limit of {MAX_BATCH:,} is a multiple of {unit:,}"
        ]
        for k, v in others.items():
            rest = unit // v
            if B % rest == 0:
                near = _closest(divisors(B // rest), v)
                fixes.append(f"or {names[k]} in {_fmt(near)}")
        raise ConfigError(
            f"global batch {B} is not divisible by {product} = {unit}; the rule is "
            f"B_global = b_m × g × d; {'; '.join(fixes)}"
        )
    values[want] = B // unit
    return BatchConfig(**values)
