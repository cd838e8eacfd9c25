"""Pipeline training: one resolved run → one process per rank → one typed report, and the
prediction made before the run (:mod:`microbatch.run.pipeline.before_run`)."""

__all__: list[str] = []
