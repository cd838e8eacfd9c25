"""Measurements from the machine: timing, host and device memory, probes, the built-in GPT.

The layer above ``schedules``, beside ``predict`` (the two do not import each other). A measured
figure comes from the allocator, the clock or the process, never from the arithmetic of a
prediction.

- ``timing``: :class:`~microbatch.measure.timing.TimingConfig`, the clocks, repeat until stable.
- ``hostmem``: resident set size of this process and its peak (Linux ``/proc``).
- ``device``: one device's clock, peak memory and freeing; out-of-memory types; several ranks.
- ``probes``: the training and decoding probes, :class:`~microbatch.measure.probes.Measurement`.
- ``spec``: a probe as plain data (:class:`~microbatch.measure.spec.ProbeSpec`) and its building.
- ``childprobe``: CPU probes in a child process under a hard memory limit.
- ``snapshot``: a host copy of a model, optimizer and random generators, restored bitwise (a tune
  leaves no trace: :func:`~microbatch.measure.snapshot.leave_no_trace`).
- ``gpt``: the built-in decoder; ``hf``: Hugging Face models from configs.
"""

__all__: list[str] = []
