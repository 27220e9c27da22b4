"""Where the workers live and how EngineCore reaches them: the `Executor` protocol and the
multi-rank base (`base`), `create_executor` (`factory`), and one executor per backend:
`UniprocExecutor` (one Worker in this process), `MultiprocExecutor` (a process per rank) and
`RayExecutor` (a Ray actor per rank).

Import rule: executor imports worker, distributed and the leaf modules (`config`, `step`,
`errors`, ...); never `engine`. The engine imports `executor.factory` and `step`, not worker.
"""
