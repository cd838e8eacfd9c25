"""``tune``'s decoding flags: how many tokens a decode probe generates after its prefill, and what the result says
it measured (split from :mod:`microbatch.commands.tune`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from microbatch.choose.tune.config import ProbeConfig

__all__ = ["new_tokens_flag", "with_decode_workload"]


def new_tokens_flag(given: int | None, mode: str) -> int:
    """``--new-tokens`` for the probe (32 where not given): refused outside decoding, where nothing is decoded."""
    from microbatch.choose.tune.config import ProbeConfig
    from microbatch.errors import ConfigError

    if given is None:
        return ProbeConfig.new_tokens
    if mode != "decode":
        raise ConfigError(
            f"--new-tokens {given} sets how many tokens decoding generates, and --mode is {mode}; give --mode decode, "
            "or drop --new-tokens",
            params=("new_tokens", "mode"),
        )
    return given


def with_decode_workload(d: dict[str, Any], probe: ProbeConfig) -> dict[str, Any]:
    """``d`` with what a decode tune measured: the tokens decoded after the prefill (at least the timing's warm-up
    and repeats: the probe decodes that many) and the prompt before them."""
    if probe.mode == "decode" and isinstance(d.get("seq"), int):
        t = probe.timing
        d["new_tokens"] = (
            max(probe.new_tokens, t.warmup + t.max_repeats) if t is not None else probe.new_tokens
        )
        d["prompt_tokens"] = d["seq"] - d["new_tokens"]
    return d
