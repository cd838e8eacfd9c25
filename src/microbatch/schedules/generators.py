"""The action orders of the built-in schedules: pure functions ``(p, m, v) -> per-rank lists``.

Each generator assumes that its (p, m, v) has passed the schedule's servability rule (see
:mod:`microbatch.schedules.rules`); :func:`microbatch.schedules.registry.generate` checks first.
Every order that torch also has is tested equal to torch's (``tests/test_schedule.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from microbatch.schedules.action import Action

__all__ = [
    "dualpipev_overlapped",
    "dualpipev_order",
    "gpipe_order",
    "interleaved_order",
    "interleaved_rounds",
    "one_f_one_b_order",
    "zb_h1_order",
    "zb_interleaved_order",
    "zbv_order",
    "zbv_planned",
]


def gpipe_order(p: int, m: int, v: int) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): all forwards, then all backwards, in micro-batch order (torch's ScheduleGPipe)."""
    return [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)] for r in range(p)]


def one_f_one_b_order(p: int, m: int, v: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021), in the order of torch's Schedule1F1B.

    Rank r runs p−1−r warm-up forwards, then alternates one forward and one backward, then
    drains the remaining backwards; so it holds at most p−r micro-batches (min(m, p−r)).
    """
    out: list[list[Action]] = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [Action(r, "F", i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            acts.append(Action(r, "F", f))
            acts.append(Action(r, "B", b))
            f += 1
            b += 1
        acts += [Action(r, "B", i) for i in range(b, m)]
        out.append(acts)
    return out


def interleaved_rounds(p: int, m: int) -> tuple[int, int]:
    """torch's ScheduleInterleaved1F1B: rounds = max(1, m // p), micro-batches per round = m // rounds."""
    rounds = max(1, m // p)
    return rounds, m // rounds


def interleaved_order(p: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021, sec 2.2), the order of torch's ScheduleInterleaved1F1B.

    Rank r owns virtual stages r, r+p, …, r+(v−1)p (loop placement). Its forwards walk the
    local stages in blocks of one round's micro-batches (depth first), backwards the reverse.
    Warm-up forwards: (v−1)·n_round + 2(p−1−r), capped at m·v (torch's ``_get_warmup_ops``).
    """
    _, per_round = interleaved_rounds(p, m)
    total = m * v
    out: list[list[Action]] = []
    for r in range(p):
        warm = min((v - 1) * per_round + 2 * (p - 1 - r), total)
        fwd_next = [0] * v
        bwd_next = [0] * v
        acts: list[Action] = []
        for op in range(total + warm):
            if op < total:  # a forward at every step but the cool-down
                local = (op // per_round) % v
                acts.append(Action(local * p + r, "F", fwd_next[local]))
                fwd_next[local] += 1
            if op >= warm:  # a backward at every step after the warm-up
                local = v - 1 - ((op - warm) // per_round) % v
                acts.append(Action(local * p + r, "B", bwd_next[local]))
                bwd_next[local] += 1
        out.append(acts)
    return out


def zb_h1_order(p: int, m: int, v: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024, sec 3.1, Fig. 3).

    The backward splits into I (input gradient, on the critical path) and W (weight
    gradient, deferrable). Rank r keeps 1F1B's warm-up (p−r forwards before its first I), then
    runs cycles "I, W, F"; rank r holds back r+1 of its W passes so that they fill the
    cool-down bubble at the end. With T_W <= T_F and T_W <= T_I the idle time per rank is
    (p−1)(T_F + T_I − T_W): a third of 1F1B's when the three times are equal. Its order equals
    torch's ScheduleInterleavedZeroBubble run with one stage per rank (tested), which runs it; with
    m < p (fewer micro-batches than 1F1B's warm-up) it is that class's one round,
    :func:`zb_interleaved_order` at v = 1 (the closed form does not hold there).
    """
    if m < p:
        return zb_interleaved_order(p, m, 1)
    out: list[list[Action]] = []
    for r in range(p):
        nf = p - r  # m >= p here
        acts = [Action(r, "F", i) for i in range(nf)]
        held = r + 1  # W passes deferred to the tail
        for k in range(m):
            acts.append(Action(r, "I", k))
            w = k - held + 1
            if 0 <= w < m - held:
                acts.append(Action(r, "W", w))
            if nf < m:
                acts.append(Action(r, "F", nf))
                nf += 1
        acts += [Action(r, "W", i) for i in range(m - held, m)]
        out.append(acts)
    return out


def zbv_planned(p: int, m: int) -> int:
    """Micro-batches torch's ScheduleZBVZeroBubble plans: max(m, 2p − 1) (it drops those >= m)."""
    return max(m, 2 * p - 1)


def zbv_order(p: int, m: int, v: int) -> list[list[Action]]:
    """ZB-V (Qi et al. 2024, sec 6), the order of torch's ScheduleZBVZeroBubble.

    Two chunks per rank in a V: rank r runs stage r on the way down and stage 2p−1−r on the
    way back. Torch plans n = max(m, 2p−1) micro-batches and drops the ones >= m. Warm-up:
    2(p−r)−1 forwards of chunk 0, then r pairs (F chunk 1, F chunk 0), then p−r triples
    (F, I, W) of chunk 1. Steady state: [F chunk 0 while any remain], I and W of chunk 0, then
    F, I, W of chunk 1, until both chunks have run n forwards. Cool-down: r pairs (I chunk 0,
    I chunk 1), p−r pairs (I, W) of chunk 0, then the W passes still owed, chunk 1 first.
    """
    n = zbv_planned(p, m)
    out: list[list[Action]] = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        acts: list[Action] = []
        f = [0, 0]  # forwards done per chunk
        i_ = [0, 0]  # input backwards done per chunk
        stage = (down, up)

        def add(
            chunk: int, kind: str, mb: int, acts: list[Action] = acts, stage: tuple[int, int] = stage
        ) -> None:
            acts.append(Action(stage[chunk], kind, mb))

        for _ in range(2 * (p - r) - 1):
            add(0, "F", f[0])
            f[0] += 1
        for _ in range(r):
            add(1, "F", f[1])
            f[1] += 1
            add(0, "F", f[0])
            f[0] += 1
        for _ in range(p - r):
            add(1, "F", f[1])
            f[1] += 1
            add(1, "I", i_[1])
            add(1, "W", i_[1])
            i_[1] += 1
        while f[1] < f[0] or f[0] < n:
            if f[0] < n:
                add(0, "F", f[0])
                f[0] += 1
            add(0, "I", i_[0])
            add(0, "W", i_[0])
            i_[0] += 1
            add(1, "F", f[1])
            f[1] += 1
            add(1, "I", i_[1])
            add(1, "W", i_[1])
            i_[1] += 1
        w = list(i_)  # weight passes done per chunk
        for _ in range(r):
            add(0, "I", i_[0])
            i_[0] += 1
            add(1, "I", i_[1])
            i_[1] += 1
        for _ in range(p - r):
            add(0, "I", i_[0])
            i_[0] += 1
            add(0, "W", w[0])
            w[0] += 1
        acts += [Action(up, "W", k) for k in range(w[1], i_[1])]
        acts += [Action(down, "W", k) for k in range(w[0], i_[0])]
        out.append([a for a in acts if a.microbatch < m])
    return out


def zb_interleaved_order(p: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved zero bubble (ZB1P, Qi et al. 2024), the order of torch's ScheduleInterleavedZeroBubble.

    Loop placement as interleaved 1F1B, with the backward split into I and W. Rank r warms up with
    (v−1)·n_round + (p−1−r) forwards (half of interleaved 1F1B's extra depth), then runs F, I
    pairs; after its first r input backwards every I is followed by the W of the oldest input
    backward still owed; the cool-down runs the remaining I (same rule) and then the owed W. With
    v = 1 this is ZB-H1 (``zb-h1``).
    """
    _, per_round = interleaved_rounds(p, m)
    total = m * v
    out: list[list[Action]] = []
    for r in range(p):
        warm = min((v - 1) * per_round + (p - 1 - r), total)

        def fwd_stage(op: int, r: int = r) -> int:
            return ((op // per_round) % v) * p + r

        def bwd_stage(op: int, r: int = r, warm: int = warm) -> int:
            return (v - 1 - ((op - warm) // per_round) % v) * p + r

        nxt: dict[tuple[str, int], int] = {}
        acts: list[Action] = []

        def add(
            kind: str, stage: int, acts: list[Action] = acts, nxt: dict[tuple[str, int], int] = nxt
        ) -> None:
            i = nxt.get((kind, stage), 0)
            nxt[(kind, stage)] = i + 1
            acts.append(Action(stage, kind, i))

        owed: list[int] = []  # stages of input backwards whose W has not run, oldest first
        for op in range(total + warm):
            if op < total:
                add("F", fwd_stage(op))
            if op >= warm:
                add("I", bwd_stage(op))
                owed.append(bwd_stage(op))
                if op - warm >= r:
                    add("W", owed.pop(0))
        for stage in owed:
            add("W", stage)
        out.append(acts)
    return out


def dualpipev_order(p: int, m: int, v: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek-V3 technical report, 2024, sec 3.2.1: DualPipe; its V-shaped "cut in half"
    variant from deepseek-ai/DualPipe), the order of torch's ScheduleDualPipeV with each overlapped
    forward+backward pair written as its two parts, forward first.

    Rank r holds stage r (chunk 0, down) and 2p−1−r (chunk 1, back up); m >= 2p. Phases:
    1. 2(p−r−1) forwards of chunk 0; 2. r+1 pairs (F chunk 0, F chunk 1); 3. p−r−1 triples
    (I chunk 1, the oldest owed W, F chunk 1); 4. m−2p+r+1 rounds of (F chunk 0, B chunk 1) and
    (F chunk 1, B chunk 0) — full backwards, overlapped in torch; 5. p−r−1 pairs (B chunk 1;
    F chunk 1, B chunk 0); 6. r+1 pairs of backwards (chunk 1, chunk 0), switching to I (split
    backward) half-way; 7. p−r−1 pairs (owed W, backward of chunk 0); 8. the r+1 owed W passes.
    """
    out: list[list[Action]] = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        acts: list[Action] = []
        nxt: dict[tuple[int, str], int] = {}  # (stage, "F" | "I") -> next micro-batch
        owed: list[tuple[int, int]] = []  # (stage, micro-batch) of I passes whose W has not run

        def add(
            stage: int,
            kind: str,
            acts: list[Action] = acts,
            nxt: dict[tuple[int, str], int] = nxt,
            owed: list[tuple[int, int]] = owed,
        ) -> None:
            key = (stage, "F" if kind == "F" else "I")  # B and I share torch's input-backward counter
            i = nxt.get(key, 0)
            nxt[key] = i + 1
            acts.append(Action(stage, kind, i))
            if kind == "I":
                owed.append((stage, i))

        def pay_w(acts: list[Action] = acts, owed: list[tuple[int, int]] = owed) -> None:
            if owed:
                stage, i = owed.pop(0)
                acts.append(Action(stage, "W", i))

        for _ in range(2 * (p - r - 1)):
            add(down, "F")
        for _ in range(r + 1):
            add(down, "F")
            add(up, "F")
        for _ in range(p - r - 1):
            add(up, "I")
            pay_w()
            add(up, "F")
        for _ in range(m - 2 * p + r + 1):
            add(down, "F")
            add(up, "B")
            add(up, "F")
            add(down, "B")
        for _ in range(p - r - 1):
            add(up, "B")
            add(up, "F")
            add(down, "B")
        split = False
        half = (r + 1) // 2
        for i in range(r + 1):
            if i == half and r % 2 == 1:
                split = True
            add(up, "I" if split else "B")
            if i == half and r % 2 == 0:
                split = True
            add(down, "I" if split else "B")
        for _ in range(p - r - 1):
            pay_w()
            add(down, "I" if split else "B")
        for _ in range(r + 1):
            pay_w()
        out.append(acts)
    return out


def dualpipev_overlapped(actions: Sequence[Sequence[Action]]) -> tuple[frozenset[int], ...]:
    """Positions of the forwards torch's ScheduleDualPipeV runs together with the next action as one
    ``OVERLAP_F_B`` step, per rank of :func:`dualpipev_order`'s output: every forward followed by a full
    backward (phases 4 and 5), except the first such pair on the last rank, which torch runs apart "to
    further reduce bubble size" (tested against torch's actions)."""
    p = len(actions)
    out = []
    for r, acts in enumerate(actions):
        pos = [i for i in range(len(acts) - 1) if acts[i].kind == "F" and acts[i + 1].kind == "B"]
        if r == p - 1 and pos:
            pos = pos[1:]
        out.append(frozenset(pos))
    return tuple(out)
